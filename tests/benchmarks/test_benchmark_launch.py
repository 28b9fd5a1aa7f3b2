"""benchmarks/launch.py: a run on host devices, and its argument checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import cpu_xla_flags, scripts

launch = scripts.load("launch")


def run(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS=cpu_xla_flags(2))
    return subprocess.run([sys.executable, str(scripts.BENCHMARKS / "launch.py"), "--cpu", *argv],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)


def test_a_run_times_every_size_and_the_scheduling_modes_at_the_largest(tmp_path):
    out = tmp_path / "launch.json"
    done = run(tmp_path, "--gpus", "1", "2", "--args", "1", "3", "--kernels", "1", "4", "--calls", "3",
               "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "device", "date", "commit", "jax", "rows"} <= set(result)
    assert result["device"].startswith("2x ")
    got = {(r["gpus"], r["args"], r["kernels"], r["mode"]) for r in result["rows"]}
    default = {(g, a, k, "default") for g in (1, 2) for a in (1, 3) for k in (1, 4)}
    modes = {(g, 3, 4, m) for g in (1, 2) for m in ("SERIALIZE", "CONCURRENT")}
    assert got == default | modes and len(result["rows"]) == len(got)
    assert all(0 < r["median_ms"] <= r["p90_ms"] for r in result["rows"])


def test_more_gpus_than_the_process_sees_exit_2_with_one_line(tmp_path):
    done = run(tmp_path, "--gpus", "4", "--args", "1", "--kernels", "1", "--calls", "1")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["--gpus 4: this process sees 2 device(s)"]


@pytest.mark.parametrize("argv", [["--gpus", "0"], ["--args", "0"], ["--kernels", "0"], ["--calls", "0"],
                                  ["--modes", "FAST"]])
def test_bad_arguments_exit_2_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        launch.parse_args(argv)
    assert stop.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]
