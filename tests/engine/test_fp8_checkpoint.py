"""FP8 checkpoints: each published layout (built by hand, tests/helpers/fp8_published.py) loads as its
float64 dequantization on shapes no block divides; block scales shard with tensor parallelism; the
layouts make-checkpoint writes load back exactly; a 16-bit checkpoint quantized at load is the FP8
checkpoint written from it; and every damaged or unserved checkpoint is one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from helpers.fp8_published import LAYOUTS, read_tensors, write_dense, write_published
from helpers.hf_reference import hf_model
from safetensors.numpy import save_file
from switchyard.kernels.weights import DenseWeight, Fp8Weight
from switchyard.service.engine.checkpoint import load_params, write_checkpoint
from switchyard.service.engine.engine import make_mesh
from switchyard.service.engine.fp8_checkpoint import check_checkpoint, quantize_checkpoint
from switchyard.service.engine.tensor_source import CheckpointError
from switchyard.service.model import quantization as quant
from switchyard.service.modelspec import ModelSpec, ModelSpecError, RopeScaling, preset

# No dimension a multiple of the 128-wide blocks: every block row and column of scales ends partial.
AWKWARD = dataclasses.replace(preset("tiny"), name="awkward", vocab_size=300, hidden_size=160, intermediate_size=200,
                              num_layers=3, num_heads=5, num_kv_heads=1, head_dim=32, rope_scaling=RopeScaling())
# Shards of two on whole 128-wide blocks (o_proj: 256 / 2; down_proj: 512 / 2).
ALIGNED = dataclasses.replace(AWKWARD, name="aligned", hidden_size=256, intermediate_size=512, num_heads=4,
                              num_kv_heads=2, head_dim=64, num_layers=2)
MATRICES = ("wqkv", "wo", "wgu", "wdown")


def _dense64(weight) -> np.ndarray:
    """A loaded weight as the float64 matrix [in, out] it stands for."""
    if isinstance(weight, DenseWeight):
        return np.asarray(weight.w, np.float64)
    assert isinstance(weight, Fp8Weight)
    q, scale = np.asarray(weight.w).astype(np.float64), np.asarray(weight.scale, np.float64)
    if weight.block_k:
        scale = np.repeat(scale, weight.block_k, axis=1)[:, : q.shape[1]]
    return (q * scale).T


def _published(tmp_path, spec: ModelSpec, layout: str, seed: int = 3):
    folder = tmp_path / layout
    published = write_published(hf_model(spec, seed=seed), folder, layout)
    dense = write_dense(tmp_path / f"{layout}-dequantized", folder, published.dequantized)
    return folder, dense, published


def _load(folder, tp: int = 1, quantization: str = "auto", dtype: str = "float32") -> dict:
    spec = ModelSpec.from_file(folder)
    return load_params(folder, spec, make_mesh(tp), dtype, progress=False, quantization=quantization)


def _assert_loads_as(fp8: dict, dense: dict, expect_fp8: list[dict[str, bool]]) -> None:
    for i, (ours, ref) in enumerate(zip(fp8["layers"], dense["layers"], strict=True)):
        for name in MATRICES:
            assert isinstance(ours[name], Fp8Weight) == expect_fp8[i][name], (i, name)
            want = _dense64(ref[name])  # float32 of the float64 dequantization
            np.testing.assert_allclose(_dense64(ours[name]), want, rtol=2e-7, atol=1e-30, err_msg=f"{i} {name}")
    for key in ("embed", "final_norm", "lm_head"):
        np.testing.assert_array_equal(np.asarray(fp8[key]), np.asarray(dense[key]))


def _expected_formats(layout: str, layers: int) -> list[dict[str, bool]]:
    if layout != "fbgemm":
        return [dict.fromkeys(MATRICES, True) for _ in range(layers)]
    # Meta's layout: attention in bfloat16 everywhere, the MLP of the first and last layers too.
    return [{"wqkv": False, "wo": False, "wgu": 0 < i < layers - 1, "wdown": 0 < i < layers - 1}
            for i in range(layers)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_published_layout_loads_as_its_float64_dequantization(tmp_path, layout):
    folder, dense, published = _published(tmp_path, AWKWARD, layout)
    spec = ModelSpec.from_file(folder)
    assert spec.quantization is not None and spec.quantization == quant.from_config(
        {"quantization_config": published.quantization_config})
    fp8 = _load(folder)
    _assert_loads_as(fp8, _load(dense), _expected_formats(layout, AWKWARD.num_layers))
    # Held as the files hold them: e4m3 [out, in], float32 scales per channel (and block of K).
    w = fp8["layers"][1]["wgu"]
    assert w.w.dtype == np.dtype("float8_e4m3fn") and w.w.shape == (2 * AWKWARD.intermediate_size, 160)
    assert w.block_k == (128 if layout.endswith("block") else 0)
    assert w.scale.shape == (400, 2 if w.block_k else 1) and w.scale.dtype == np.float32
    # The summary check_checkpoint gives serve before it loads.
    summary = {"fbgemm": "10 dense, 2 fp8", "ct-block": "fp8/128", "fp8-block": "fp8/128"}.get(layout, "fp8")
    assert check_checkpoint(folder, spec) == summary
    # none: every matrix dense, each the same dequantization.
    _assert_loads_as(_load(folder, quantization="none"), _load(dense),
                     [dict.fromkeys(MATRICES, False) for _ in range(AWKWARD.num_layers)])


@pytest.mark.parametrize("layout", ["ct-channel", "fp8-block", "ct-tensor"])
def test_fp8_weights_shard_with_their_scales_over_two_devices(tmp_path, layout):
    folder, dense, _ = _published(tmp_path, ALIGNED, layout)
    fp8 = _load(folder, tp=2)
    _assert_loads_as(fp8, _load(dense, tp=2), _expected_formats(layout, ALIGNED.num_layers))
    down = fp8["layers"][0]["wdown"]
    shards = sorted(down.w.addressable_shards, key=lambda s: s.index[1].start or 0)
    assert [s.data.shape for s in shards] == [(256, 256)] * 2  # [out, in / 2]
    scale_shapes = {s.data.shape for s in down.scale.addressable_shards}
    assert scale_shapes == ({(256, 2)} if down.block_k else {(256, 1)})  # block scales by block of K


def test_block_scales_that_a_shard_would_split_are_refused(tmp_path):
    folder, _, _ = _published(tmp_path, dataclasses.replace(ALIGNED, intermediate_size=384), "fp8-block")
    with pytest.raises(CheckpointError, match=r"^model.layers.0.mlp.down_proj.weight: 384 input features over 2 shards "
                                              r"is 192 a shard, not a whole number of 128-wide scale blocks; serve it "
                                              r"at another --tp or with --quantization none$"):
        _load(folder, tp=2)
    # Dequantized, the same checkpoint shards anywhere.
    assert isinstance(_load(folder, tp=2, quantization="none")["layers"][0]["wdown"], DenseWeight)


@pytest.mark.parametrize("name", list(quant.WRITTEN))
def test_what_make_checkpoint_writes_loads_back_and_quantize_on_load_matches_it(tmp_path, name):
    """A written FP8 checkpoint: its published layout, loaded back to exactly the e4m3 values and
    scales it wrote; the per-channel one is bit for bit what quantizing its 16-bit source at load makes."""
    fmt = quant.WRITTEN[name]
    spec = dataclasses.replace(AWKWARD, dtype="bfloat16")
    source = write_checkpoint(spec, tmp_path / "bf16", seed=4, progress=False)
    folder = quantize_checkpoint(source, tmp_path / name, fmt)
    config = json.loads((folder / "config.json").read_text())
    assert quant.from_config(config) == fmt and (folder / "tokenizer.json").exists()
    files = read_tensors(folder / "model.safetensors")
    q_name = "model.layers.2.self_attn.q_proj"
    assert files[f"{q_name}.weight"].dtype == np.dtype("float8_e4m3fn")
    assert files[f"{q_name}.{fmt.scale_name}"].shape in fmt.scale_shapes(160, 160)
    assert ("model.layers.0.mlp.down_proj.input_scale" in files) == (fmt.activations == "static")
    assert files["lm_head.weight"].dtype == np.dtype("bfloat16")
    loaded = _load(folder, dtype="bfloat16")
    q = loaded["layers"][2]["wqkv"]
    assert isinstance(q, Fp8Weight)
    np.testing.assert_array_equal(np.asarray(q.w)[:160].view(np.uint8), files[f"{q_name}.weight"].view(np.uint8))
    # A 16-bit source quantized here, and the make-checkpoint one written by the same code path as
    # write_checkpoint's presets, agree with the quantized files.
    if fmt == quant.PER_CHANNEL:
        on_load = _load(source, quantization="fp8", dtype="bfloat16")
        for a, b in zip(jax_leaves(loaded), jax_leaves(on_load), strict=True):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        written = write_checkpoint(dataclasses.replace(spec, quantization=fmt), tmp_path / "direct", seed=4,
                                   progress=False)
        direct = read_tensors(written / "model.safetensors")
        assert direct.keys() == files.keys()
        for key, value in files.items():
            np.testing.assert_array_equal(direct[key].view(np.uint8), value.view(np.uint8))


def jax_leaves(tree) -> list:
    import jax

    return jax.tree.leaves(tree)


# ---- damaged and unserved checkpoints: one line each ------------------------------------------------
def _damaged(tmp_path, layout: str, change) -> str:
    """The message of a load of ``layout`` after ``change(tensors, config)``."""
    folder, _, _ = _published(tmp_path, AWKWARD, layout)
    tensors = read_tensors(folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    change(tensors, config)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises((CheckpointError, ModelSpecError)) as err:
        _load(folder)
    message = str(err.value)
    assert "\n" not in message and len(message) < 300, message
    return message


Q = "model.layers.1.self_attn.q_proj"


def test_a_missing_weight_scale_is_named(tmp_path):
    msg = _damaged(tmp_path, "ct-channel", lambda t, c: t.pop(f"{Q}.weight_scale"))
    assert msg == (f"{Q}.weight is float8 but the checkpoint has no {Q}.weight_scale (compressed-tensors, "
                   "channel scales)")


def test_a_missing_static_input_scale_is_named(tmp_path):
    folder, _, _ = _published(tmp_path, AWKWARD, "ct-tensor")
    tensors = read_tensors(folder / "model.safetensors")
    del tensors[f"{Q}.input_scale"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"static activation scales, but the checkpoint has no {Q}.input_scale"):
        check_checkpoint(folder, ModelSpec.from_file(folder))


@pytest.mark.parametrize(("layout", "scale", "shape"), [("ct-channel", "weight_scale", (159, 1)),
                                                        ("fp8-block", "weight_scale_inv", (2, 1)),
                                                        ("ct-tensor", "weight_scale", (2,))])
def test_a_misshapen_scale_is_named_with_the_shape_it_should_have(tmp_path, layout, scale, shape):
    def change(t, c):
        t[f"{Q}.{scale}"] = np.ones(shape, np.float32)

    msg = _damaged(tmp_path, layout, change)
    assert msg.startswith(f"{Q}.{scale} has shape {list(shape)}; the ")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -0.5])
def test_a_scale_that_is_not_finite_or_is_negative_is_refused(tmp_path, bad):
    def change(t, c):
        t[f"{Q}.weight_scale_inv"] = t[f"{Q}.weight_scale_inv"].copy()
        t[f"{Q}.weight_scale_inv"][1, 0] = bad

    msg = _damaged(tmp_path, "fp8-block", change)
    assert msg.startswith(f"{Q}.weight_scale_inv holds {bad} at [1, 0]: scales must be finite and not negative")


def test_a_misshapen_fp8_weight_is_named(tmp_path):
    def change(t, c):
        t[f"{Q}.weight"] = t[f"{Q}.weight"][:, :100]

    assert _damaged(tmp_path, "ct-channel", change) == f"tensor {Q}.weight has shape (160, 100), the config implies " \
                                                       "(160, 160)"


def test_a_fused_matrix_half_in_fp8_is_refused(tmp_path):
    def change(t, c):
        k = "model.layers.1.self_attn.k_proj"
        t[f"{k}.weight"] = t[f"{k}.weight"].astype(np.float32)

    msg = _damaged(tmp_path, "ct-channel", change)
    assert msg.startswith("layer 1 mixes FP8 and 16-bit tensors in one fused matrix")
    assert msg.endswith("serve it with --quantization fp8 or none")


def test_float8_tensors_without_a_quantization_config_are_refused(tmp_path):
    msg = _damaged(tmp_path, "ct-channel", lambda t, c: c.pop("quantization_config"))
    assert msg == "the checkpoint holds float8 tensors, but its config.json states no quantization_config"


def test_a_quantization_config_over_16_bit_tensors_is_refused(tmp_path):
    folder = write_checkpoint(AWKWARD, tmp_path / "dense", progress=False)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quant.PER_CHANNEL.to_config()
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"^config.json states FP8 quantization \(compressed-tensors\) but no "
                                              r"layer matrix in the checkpoint is float8$"):
        _load(folder)


@pytest.mark.parametrize(("quantization_config", "message"), [
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method 'awq' is not served (FP8 formats: "
                                         "compressed-tensors, fbgemm_fp8, fp8)"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "quantization_config.fmt 'e5m2' is not served (e4m3 only)"),
    ({"quant_method": "fp8", "weight_block_size": [128]},
     "quantization_config.weight_block_size must be two positive integers, got [128]"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}},
     "quantization_config.config_groups.g.weights is 8-bit 'int': only 8-bit float (FP8) weights are served"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}},
     "quantization_config.format 'pack-quantized' is not served (FP8 e4m3 weights: float-quantized)"),
    ("fp8", "quantization_config must be an object"),
])
def test_a_quantization_config_that_is_not_a_served_fp8_format_is_one_line(tmp_path, quantization_config, message):
    config = {**AWKWARD.to_config(), "quantization_config": quantization_config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSpecError) as err:
        ModelSpec.from_file(tmp_path)
    assert str(err.value) == message


def test_layers_held_unlike_each_other_cannot_be_split_into_pipeline_stages(tmp_path):
    folder, _, _ = _published(tmp_path, dataclasses.replace(AWKWARD, num_layers=4), "fbgemm")
    spec = ModelSpec.from_file(folder)
    mesh = make_mesh(1, pp=2)
    with pytest.raises(ValueError, match=r"^pipeline stages need layer 2 to hold its weights as layer 0 does "
                                         r"\(2 dense, 2 fp8 vs dense\); serve this checkpoint with one stage"):
        load_params(folder, spec, mesh, "float32", progress=False, stages=2)
