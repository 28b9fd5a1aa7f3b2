"""FP8 checkpoints built by hand in the layouts the Hugging Face hub's FP8 releases have (tensor names,
scale shapes and dtypes, and the config's quantization_config), written here without the product's
code, with each tensor's float64 dequantization as the reference.

* ``ct-tensor``: compressed-tensors, a float32 weight_scale [1] per tensor and a static input_scale [1]
  (llm-compressor's FP8 scheme, as neuralmagic's ``*-FP8`` releases);
* ``ct-channel``: compressed-tensors, a bfloat16 weight_scale [out, 1] per channel, dynamic per-token
  activations (``FP8_DYNAMIC``);
* ``ct-block``: compressed-tensors, block strategy, weight_scale [ceil(out/128), ceil(in/128)];
* ``fbgemm``: FBGEMM FP8 as Meta's Llama-3.1-405B FP8: weight_scale [out, 1] float32 and an
  input_scale_ub [1] per linear; the attention projections and the first and last layers left in
  bfloat16 (``modules_to_not_convert``);
* ``fp8-block``: ``quant_method: fp8`` with ``weight_block_size`` [128, 128] (DeepSeek's and Qwen3's FP8
  releases): weight_scale_inv [ceil(out/128), ceil(in/128)] float32, multiplied in;
* ``fp8-tensor``: ``quant_method: fp8`` without a block size (AutoFP8): weight_scale [] and input_scale [].
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors.numpy import save_file

LAYOUTS = ("ct-tensor", "ct-channel", "ct-block", "fbgemm", "fp8-block", "fp8-tensor")
E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0
BLOCK = 128
LINEAR = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)_proj\.weight$")


@dataclasses.dataclass
class Published:
    quantization_config: dict
    tensors: dict[str, np.ndarray]  # as the files hold them
    dequantized: dict[str, np.ndarray]  # float64: what each tensor the model reads stands for


def _config(layout: str, num_layers: int) -> dict:
    def ct(strategy: str, dynamic: bool | None, block: list[int] | None = None) -> dict:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                   "observer": "minmax", "block_structure": block}
        acts = None if dynamic is None else {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic,
                                             "strategy": "token" if dynamic else "tensor"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
                "ignore": ["lm_head"], "kv_cache_scheme": None, "version": "0.9.1"}

    if layout == "ct-tensor":
        return ct("tensor", False)
    if layout == "ct-channel":
        return ct("channel", True)
    if layout == "ct-block":
        return ct("block", True, [BLOCK, BLOCK])
    if layout == "fbgemm":
        skip = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(num_layers) for p in "qkvo"]
        skip += [f"model.layers.{i}.mlp.{p}_proj" for i in (0, num_layers - 1) for p in ("gate", "up", "down")]
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": skip}
    if layout == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
    if layout == "fp8-tensor":
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}
    raise ValueError(layout)


def _to_e4m3(w: np.ndarray, full_scale: np.ndarray) -> np.ndarray:
    return np.clip(w / full_scale, -E4M3_MAX, E4M3_MAX).astype(np.float32).astype(E4M3)


def _quantize(layout: str, w: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One [out, in] matrix: its files' tensors by suffix and its float64 dequantization."""
    out, inp = w.shape
    amax = np.abs(w)
    if layout in ("ct-block", "fp8-block"):
        ob, ib = math.ceil(out / BLOCK), math.ceil(inp / BLOCK)
        blocks = np.zeros((ob * BLOCK, ib * BLOCK))
        blocks[:out, :inp] = amax
        scale = (blocks.reshape(ob, BLOCK, ib, BLOCK).max(axis=(1, 3)) / E4M3_MAX).astype(np.float32)
        full = np.kron(scale.astype(np.float64), np.ones((BLOCK, BLOCK)))[:out, :inp]
        name = "weight_scale_inv" if layout == "fp8-block" else "weight_scale"
        q = _to_e4m3(w, full)
        return {"weight": q, name: scale}, q.astype(np.float64) * full
    if layout in ("ct-channel", "fbgemm"):
        dtype = ml_dtypes.bfloat16 if layout == "ct-channel" else np.float32
        scale = (amax.max(axis=1, keepdims=True) / E4M3_MAX).astype(dtype)
        full = scale.astype(np.float64)
        q = _to_e4m3(w, full)
        files = {"weight": q, "weight_scale": scale}
        if layout == "fbgemm":
            files["input_scale_ub"] = np.array([1200.0], np.float32)
        return files, q.astype(np.float64) * full
    shape = (1,) if layout == "ct-tensor" else ()
    scale = np.full(shape, amax.max() / E4M3_MAX, np.float32)
    q = _to_e4m3(w, scale.astype(np.float64).reshape(()))
    files = {"weight": q, "weight_scale": scale, "input_scale": np.full(shape, 0.05, np.float32)}
    return files, q.astype(np.float64) * float(scale.reshape(()))


def publish(state: dict[str, np.ndarray], layout: str, num_layers: int) -> Published:
    """The tensors of a dense model's ``state`` (name -> float64) as ``layout`` publishes them."""
    config = _config(layout, num_layers)
    skip = set(config.get("modules_to_not_convert", ()))
    tensors: dict[str, np.ndarray] = {}
    dequantized: dict[str, np.ndarray] = {}
    for name, value in state.items():
        module = name.removesuffix(".weight")
        if not LINEAR.match(name) or module in skip:
            dtype = ml_dtypes.bfloat16 if layout == "fbgemm" else np.float32
            tensors[name] = value.astype(dtype)
            dequantized[name] = tensors[name].astype(np.float64)
            continue
        files, dequantized[name] = _quantize(layout, value)
        tensors.update({f"{module}.{suffix}": t for suffix, t in files.items()})
    return Published(config, tensors, dequantized)


def write_published(model: torch.nn.Module, folder: Path, layout: str) -> Published:
    """``model`` (a transformers model) saved to ``folder`` in ``layout``: its config.json with the
    layout's quantization_config and one model.safetensors."""
    model.save_pretrained(folder, safe_serialization=True)
    state = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    config = json.loads((folder / "config.json").read_text())
    published = publish(state, layout, config["num_hidden_layers"])
    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file(published.tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = published.quantization_config
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return published


def write_dense(folder: Path, config_from: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A float32 checkpoint of ``tensors`` with ``config_from``'s config.json less its quantization."""
    folder.mkdir(parents=True, exist_ok=True)
    config = json.loads((config_from / "config.json").read_text())
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    return folder


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as NumPy (float8 ones too, which safetensors' NumPy reader
    does not take: read through torch and viewed as ml_dtypes' type)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (not a mapping)
            t = f.get_tensor(name)
            if t.dtype == torch.float8_e4m3fn:
                out[name] = t.view(torch.uint8).numpy().view(E4M3)
            elif t.dtype == torch.bfloat16:
                out[name] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            else:
                out[name] = t.numpy()
    return out


def load_into(model: torch.nn.Module, tensors: dict[str, np.ndarray]) -> torch.nn.Module:
    """``model`` with its parameters set to ``tensors`` (float64, cast to the model's dtype)."""
    state = model.state_dict()
    model.load_state_dict({k: torch.from_numpy(tensors[k]).to(state[k].dtype) for k in state}, strict=True)
    return model
