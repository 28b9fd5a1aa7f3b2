"""benchmarks/fp8.py on host devices: every product and pool it times is checked against its
reference, the result file says so, and a failed check fails the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import cpu_xla_flags, scripts

SCRIPT = scripts.BENCHMARKS / "fp8.py"


def test_fp8_benchmark_checks_and_times_every_product_and_pool(tmp_path):
    out = tmp_path / "fp8.json"
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS=cpu_xla_flags(1))
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--rows", "1", "16", "--batch", "2",
                          "--context", "128", "--layers", "2", "--repeats", "2", "--splits", "2", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["checks_passed"] and "all checks passed" in run.stdout
    kinds = {(r["matrix"], r["rows"], r["kind"], r["block_k"]) for r in result["products"]}
    for matrix in ("qkv", "o", "gate_up", "down"):
        for rows in (1, 16):
            kinds_at = {(matrix, rows, k, 0) for k in ("bf16", "w8a16", "w8a8", "w8a16-split-2")}
            assert kinds_at | {(matrix, rows, "w8a16", 128)} <= kinds
    checked = [r for r in result["products"] if r["kind"] != "bf16"]
    assert all(r["ok"] and r["us_per_product"] > 0 for r in checked)
    assert min(r["min_cosine"] for r in checked if r["kind"].startswith("w8a8")) >= 0.999
    assert all(r["tflops"] > 0 for r in result["products"])
    assert {r["pool"] for r in result["kv_attention"]} == {"bf16-kernel", "bf16-xla", "fp8-xla"}
    assert result["kv_tokens_fp8_over_bf16"] > 1.9


def test_the_w8a8_crossover_is_where_fp8_x_fp8_stays_faster_on_every_matrix():
    fp8 = scripts.load("fp8")

    def rows(times: dict[int, tuple[float, float]]) -> list[dict]:
        return [{"matrix": m, "rows": n, "kind": kind, "block_k": 0, "us_per_product": t}
                for n, pair in times.items() for m in ("a", "b") for kind, t in zip(("w8a16", "w8a8"), pair,
                                                                                     strict=True)]

    assert fp8.w8a8_crossover(rows({1: (1, 2), 64: (3, 2), 256: (5, 2)})) == 64
    assert fp8.w8a8_crossover(rows({1: (1, 2), 64: (3, 2), 256: (1, 2)})) is None
