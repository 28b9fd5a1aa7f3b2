"""FP8 on the command line: make-checkpoint writes each FP8 layout; serve takes --quantization and
--kv-cache-dtype (flags, environment, layout file), refuses a bad value or a damaged FP8 checkpoint in
one line before the port opens, and serves FP8 with ModelInfo, its log and its traces saying which
formats."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import cli_process
from helpers.cli_process import assert_one_line
from helpers.serve_process import serve_tiny, serving, wait_for
from safetensors import safe_open
from switchyard.cli import serve as serve_cli
from switchyard.service.api.client import DecodeClient
from switchyard.service.modelspec import ModelSpec, ServingLayout

pytestmark = pytest.mark.timeout(600)


def switchyard(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return cli_process.switchyard(*argv, env=env, timeout=300)


@pytest.fixture(scope="module")
def fp8_block_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fp8") / "tiny-fp8-block"
    done = switchyard("make-checkpoint", "--preset", "tiny", "--out", str(out), "--quantization", "fp8-block")
    assert done.returncode == 0, done.stderr
    assert "fp8 e4m3 (fp8, 128x128 block weight scales, dynamic activation scales)" in done.stdout, done.stdout
    return out


def test_make_checkpoint_writes_the_block_wise_layout(fp8_block_dir: Path) -> None:
    config = json.loads((fp8_block_dir / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                             "weight_block_size": [128, 128]}
    with safe_open(str(fp8_block_dir / "model.safetensors"), framework="pt") as f:
        scale = f.get_slice("model.layers.0.mlp.down_proj.weight_scale_inv")
        assert scale.get_shape() == [1, 3] and scale.get_dtype() == "F32"  # [128 / 128, ceil(352 / 128)]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_dtype() == "F8_E4M3"
    assert ModelSpec.from_file(fp8_block_dir).quantization.block == (128, 128)


def test_fp8_mistakes_get_one_line_before_the_port_opens(fp8_block_dir: Path, tmp_path: Path) -> None:
    env = {"JAX_PLATFORMS": "cpu"}
    assert_one_line(switchyard("serve", "--tiny", "--quantization", "int4", env=env),
                    "--quantization must be one of auto, none, fp8", "'int4'")
    assert_one_line(switchyard("serve", "--tiny", "--kv-cache-dtype", "fp16", env=env),
                    "--kv-cache-dtype must be one of auto, fp8", "'fp16'")
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for f in fp8_block_dir.iterdir():
        if f.name != "model.safetensors":
            (damaged / f.name).symlink_to(f)
    with safe_open(str(fp8_block_dir / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "model.layers.2.self_attn.o_proj.weight_scale_inv"}  # noqa: SIM118
    from safetensors.torch import save_file

    save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    assert_one_line(switchyard("serve", "--model-path", str(damaged), "--port", "1", env=env),
                    "model.layers.2.self_attn.o_proj.weight is float8 but the checkpoint has no "
                    "model.layers.2.self_attn.o_proj.weight_scale_inv")


def test_the_format_flags_set_the_layout_and_the_layout_file_wins(monkeypatch, tmp_path: Path) -> None:
    def resolve(*argv: str) -> ServingLayout:
        parser = argparse.ArgumentParser()
        serve_cli.add_arguments(parser)
        return serve_cli.resolve_layout(parser.parse_args(list(argv)))

    for name in ("QUANTIZATION", "KV_CACHE_DTYPE"):
        monkeypatch.delenv(f"SWITCHYARD_{name}", raising=False)
    assert (resolve().quantization, resolve().kv_cache_dtype) == ("auto", "auto")
    flags = resolve("--quantization", "fp8", "--kv-cache-dtype", "fp8")
    assert (flags.quantization, flags.kv_cache_dtype) == ("fp8", "fp8")
    monkeypatch.setenv("SWITCHYARD_QUANTIZATION", "none")
    assert resolve().quantization == "none"
    file = tmp_path / "layout.json"
    file.write_text(json.dumps({"quantization": "fp8", "kv_cache_dtype": "fp8"}))
    both = resolve("--layout", str(file), "--quantization", "none")
    assert (both.quantization, both.kv_cache_dtype) == ("fp8", "fp8")


def test_serve_quantizes_at_load_and_model_info_says_which_formats(tmp_path: Path) -> None:
    with serve_tiny(tmp_path, slots=2, max_seq_len=64,
                    extra=("--quantization", "fp8", "--kv-cache-dtype", "fp8", "--kv-tokens", "256", "--trace-file",
                           str(tmp_path / "traces.jsonl"))) as (proc, target, log):
        client = DecodeClient(target)
        wait_for(lambda: client.model_info(timeout=2).ready and serving(target), 300,
                 f"SERVING ({log.read_text()[-2000:]})")
        info = client.model_info()
        assert info.weights.startswith("fp8 e4m3 (quantized at load, per-channel weight scales, dynamic activation "
                                       "scales); FP8 x FP8 from 128 rows"), info.weights
        assert info.kv_cache == "fp8 e4m3 (float32 scale per position and KV head)"
        from switchyard.service.proto import decode_pb2

        result = client.generate(decode_pb2.GenerateRequest(text="hello there", max_tokens=4), timeout=120)
        assert 1 <= len(result.token_ids) <= 4 and result.finish_reason in ("length", "stop")
        assert "serving weights: fp8 e4m3 (quantized at load, per-channel" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    # The request's span says which formats served it.
    traces = (tmp_path / "traces.jsonl").read_text()
    assert '"switchyard.engine.weights"' in traces and "fp8 e4m3 (quantized at load" in traces
    assert '"switchyard.engine.kv_cache"' in traces
