"""benchmarks/decode.py on host devices: rows for every configuration, and the ``none`` variant
(the step without communication, for the all-reduces' share) really has no all-reduce left."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import scripts
from switchyard.service.modelspec import preset

SCRIPT = scripts.BENCHMARKS / "decode.py"


def test_decode_benchmark_rows_and_the_variant_without_communication(tmp_path):
    out, hlo = tmp_path / "decode.json", tmp_path / "hlo"
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--tp", "2", "--strategy", "xla", "none",
                          "--batch", "1", "--context", "16", "--steps", "3", "--warmup", "1", "--copy-gib", "0.01",
                          "--hlo-dir", str(hlo), "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["tp"], r["strategy"]) for r in rows] == [(2, "xla"), (2, "none")]
    spec = preset("tiny")
    for row in rows:
        assert row["ms_per_token"] > 0 and row["fraction_of_roofline"] > 0
        # every parameter byte (the embedding table whole) + KV, against the bytes a step must read
        want = (spec.param_bytes + 16 * spec.kv_bytes_per_token) / spec.decode_bytes_per_step(1, 16)
        assert want > 1 and abs(row["roofline_all_weights_ms"] / row["roofline_ms"] - want) < 0.02  # 4-decimal rounding
        fraction = row["roofline_all_weights_ms"] / row["ms_per_token"]
        assert abs(row["fraction_of_roofline_all_weights"] - fraction) < 1e-3
    with_comm = (hlo / "step-tp2-b1-xla-kernel.hlo.txt").read_text()
    without = (hlo / "step-tp2-b1-none-kernel.hlo.txt").read_text()
    assert "all-reduce" in with_comm
    assert "all-reduce" not in without


def test_decode_benchmark_times_the_torch_peer_in_the_same_run(tmp_path):
    out = tmp_path / "decode.json"
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS="--xla_force_host_platform_device_count=1")
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
