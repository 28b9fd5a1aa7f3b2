"""benchmarks/sampling.py: a run on host devices, and its argument checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import scripts

sampling = scripts.load("sampling")


def test_a_run_times_each_part_and_checks_the_grouped_top_k(tmp_path):
    out = tmp_path / "sampling.json"
    run = subprocess.run([sys.executable, str(scripts.BENCHMARKS / "sampling.py"), "--cpu", "--vocab", "20000",
                          "--batch", "1", "3", "--calls", "2", "--repeats", "1", "--out", str(out)],
                         env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "device", "date", "commit", "jax", "rows"} <= set(result)
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert row["candidates"] == 1024 and row["top_k_by_groups_equals_lax_top_k"] is True
        assert min(row[k] for k in ("greedy_ms", "sampled_ms", "lax_top_k_ms", "top_k_by_groups_ms")) > 0


@pytest.mark.parametrize("argv", [["--vocab", "1"], ["--batch", "0"], ["--calls", "0"]])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        sampling.parse_args(argv)
    assert stop.value.code == 2
    assert "at least" in capsys.readouterr().err.strip().splitlines()[-1]
