"""benchmarks/decode.py on host devices: rows for every configuration with the roofline's accounting,
the HLO of each configuration's own decode step (all-reduces over both devices at TP=2 only), and the
PyTorch peer in the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import cpu_xla_flags, scripts
from switchyard.service.modelspec import preset

SCRIPT = scripts.BENCHMARKS / "decode.py"


def test_decode_benchmark_rows_and_each_configurations_step_hlo(tmp_path):
    out, hlo = tmp_path / "decode.json", tmp_path / "hlo"
    flags = cpu_xla_flags(2)
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS=flags)
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tp", "1", "2", "--strategy", "xla",
                          "--batch", "2", "--context", "16", "--steps", "3", "--warmup", "1", "--copy-gib", "0.01",
                          "--hlo-dir", str(hlo), "--profile-dir", str(tmp_path / "profile"), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["tp"], r["strategy"], r["attention"], r["min_batch_bucket"]) for r in rows] == [
        (1, "xla", "kernel", 2), (2, "xla", "kernel", 2)]  # the engine's narrowest width by default
    assert result["xla_flags"] == flags  # the run's, not the HLO dump's
    spec = preset("tiny")
    for row in rows:
        assert row["ms_per_token"] > 0 and row["fraction_of_roofline"] > 0 and row["synchronous_ms_per_token"] > 0
        assert row["host_launch_ms"] > 0
        # every parameter byte (the embedding table whole) + KV, against the bytes a step must read
        want = (spec.param_bytes + 2 * 16 * spec.kv_bytes_per_token) / spec.decode_bytes_per_step(2, 16)
        assert want > 1 and abs(row["roofline_all_weights_ms"] / row["roofline_ms"] - want) < 0.02  # 4-decimal rounding
        fraction = row["roofline_all_weights_ms"] / row["ms_per_token"]
        assert abs(row["fraction_of_roofline_all_weights"] - fraction) < 1e-3
        assert row["profile"]["steps"] == 8  # after the timing (no GPU events on host devices)
    # each configuration's own decode step: its sums over the devices span both at TP=2, one at TP=1
    one, two = ((hlo / f"step-tp{tp}-b2-xla-kernel.hlo.txt").read_text() for tp in (1, 2))
    assert "all-reduce" in two and "replica_groups={{0,1}}" in two
    assert "replica_groups={{0,1}}" not in one
    assert "hlo:" in run.stdout


def test_a_step_without_communication_is_no_strategy_any_more(capsys):
    decode = scripts.load("decode")
    with pytest.raises(SystemExit) as stop:
        decode.parse_args(["--strategy", "xla", "none"])
    assert stop.value.code == 2 and "invalid choice: 'none'" in capsys.readouterr().err


def test_decode_benchmark_times_the_torch_peer_in_the_same_run(tmp_path):
    out = tmp_path / "decode.json"
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS=cpu_xla_flags(1))
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tp", "1", "--batch", "1", "2",
                          "--context", "16", "--steps", "3", "--warmup", "1", "--copy-gib", "0.01",
                          "--peer", "torch-compile", "--peer-sdpa", "math", "--peer-device", "cpu", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    peer = result["peer"]["rows"]
    assert [(r["batch"], r["context"]) for r in peer] == [(1, 16), (2, 16)]
    assert all(r["ms_per_token"] > 0 and r["impl"] == "torch-eager" for r in peer)
    assert "ours / peer" in run.stdout


def test_step_profile_sums_kernel_events_per_step():
    decode = scripts.load("decode")
    events = [{"name": "gemm_a", "ts": 0.0, "dur": 10.0}, {"name": "attention", "ts": 12.0, "dur": 20.0},
              {"name": "gemm_b", "ts": 40.0, "dur": 4.0}]
    summary = decode.step_profile(events, steps=2, name_chars=4, top=1)
    # busy 34 us, span 0..44 us; names cut to 4 characters merge the two products (14 us) under "gemm"
    assert summary == {"steps": 2, "gpu_busy_us_per_step": 17.0, "gpu_span_us_per_step": 22.0,
                       "top_kernels": [{"name": "atte", "count": 1, "total_us_per_step": 10.0}]}


def test_decode_benchmark_rows_of_fp8_weights_and_kv_count_their_bytes(tmp_path):
    """--weights and --kv-cache build their engines through EngineConfig: FP8 rows carry the weights'
    label, and their roofline counts FP8 bytes (about half the weights' of bf16)."""
    out = tmp_path / "decode.json"
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS=cpu_xla_flags(1))
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tp", "1", "--batch", "2", "--context",
                          "16", "--steps", "3", "--warmup", "1", "--copy-gib", "0.01", "--weights", "bf16",
                          "fp8-w8a16", "--kv-cache", "auto", "fp8", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["weights"], r["kv_cache"]) for r in rows] == [("bf16", "auto"), ("bf16", "fp8"),
                                                             ("fp8-w8a16", "auto"), ("fp8-w8a16", "fp8")]
    spec = preset("tiny")
    fp8 = spec.served_as("fp8")
    assert rows[0]["weights_label"] == "bfloat16"
    label = rows[2]["weights_label"]
    assert label.startswith("fp8 e4m3 (quantized at load") and "weight-only products" in label
    for row, model, kv in zip(rows, (spec, spec, fp8, fp8), ("auto", "fp8", "auto", "fp8"), strict=True):
        assert row["ms_per_token"] > 0
        # the bytes a step reads as served, against the bf16 row's
        want = model.decode_bytes_per_step(2, 16, kv) / (spec.decode_bytes_per_step(2, 16))
        assert abs(row["roofline_ms"] / rows[0]["roofline_ms"] - want) < 0.01
    assert rows[2]["roofline_ms"] < 0.7 * rows[0]["roofline_ms"]
