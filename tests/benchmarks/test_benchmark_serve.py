"""benchmarks/serve.py on the tiny preset on host devices: both paths, tracing off and on, on one engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import scripts


def test_serve_benchmark_on_the_tiny_preset(tmp_path):
    out = tmp_path / "serve.json"
    argv = ["--preset", "tiny", "--batch-slots", "2", "--max-seq-len", "64", "--prompt-tokens", "8",
            "--max-tokens", "4", "--concurrency", "1,2", "--repeats", "1", "--out", str(out)]
    run = subprocess.run([sys.executable, str(scripts.BENCHMARKS / "serve.py"), *argv],
                         env=dict(os.environ, PYTHONSAFEPATH="1", JAX_PLATFORMS="cpu"), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"].endswith("cpu") and result["config"]["batch_slots"] == 2
    rows = result["rows"]
    assert [(r["concurrency"], r["path"], r["tracing"]) for r in rows] == [
        (n, path, tracing) for n in (1, 2) for tracing in (False, True) for path in ("in-process", "grpc")]
    for row in rows:
        assert row["tokens_per_s"] > 0 and 0 < row["tokens"] <= 4 * row["concurrency"]
        assert (row["grpc_overhead"] is None) == (row["path"] == "in-process")
        assert (row["tracing_overhead"] is None) == (not row["tracing"])
