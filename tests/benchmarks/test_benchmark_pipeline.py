"""benchmarks/pipeline.py end to end on host devices: the group's check passes and every row is written,
each step giving every stream a token."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import cpu_xla_flags, scripts

SCRIPT = scripts.BENCHMARKS / "pipeline.py"


def test_pipeline_benchmark_runs_its_check_and_both_layouts(tmp_path):
    out = tmp_path / "pipeline.json"
    env = dict(os.environ, PYTHONSAFEPATH="1")
    env["XLA_FLAGS"] = cpu_xla_flags(1)  # the script sets each part's device count after these flags
    run = subprocess.run([sys.executable, str(SCRIPT), "--cpu", "--model", "tiny", "--streams", "1", "4",
                          "--context", "16", "--steps", "4", "--warmup", "1", "--timeout", "240", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["check"]["identical_to_tp1"] is True and result["check"]["tokens"] > 100
    rows = {(r["layout"], r["streams"]): r for r in result["rows"]}
    assert set(rows) == {("PP2", 1), ("PP2", 4), ("TP2", 1), ("TP2", 4)}
    assert rows["PP2", 4]["batch_slots"] == 4 and rows["PP2", 1]["batch_slots"] == 2
    for (_, streams), row in rows.items():
        assert row["tokens_per_s"] > 0 and row["steps"] == 4
        # a step, pipelined or not, gives every stream a token
        assert row["tokens"] == 4 * streams
    assert "throughput_vs_tp" in rows["PP2", 1]
