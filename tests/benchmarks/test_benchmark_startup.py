"""benchmarks/startup.py's reading of a start-up log: WARNING and ERROR lines from XLA's C++ logger,
from Python's loggers and from its warnings module, grouped by message with their numbers blanked;
INFO lines and the rest not counted. (The starts themselves run ``serve`` on a GPU-sized checkpoint;
the serve tests cover a start on CPU.)"""

from __future__ import annotations

import pytest
from helpers import scripts

startup = scripts.load("startup")

LOG = """\
2026-11-27 00:17:57,197 INFO switchyard.service.api.server: listening on 127.0.0.1:41711
W1127 00:14:28.670171    2460 cuda_timer.cc:88] Delay kernel timed out: measured time has sub-optimal accuracy.
W1127 00:14:29.100000    2461 cuda_timer.cc:88] Delay kernel timed out: measured time has sub-optimal accuracy.
E1126 23:55:17.124219    2850 gpu_hlo_schedule.cc:1] The byte size (69839917200) exceeds the base limit (68013994803)
2026-11-27 00:20:24,656 WARNING switchyard.service.api.server: stopped while loading the model
/opt/jax/_src/compiler.py:819: UserWarning: Error reading persistent compilation cache entry
  warnings.warn(
"""


def test_the_log_reading_counts_warnings_and_errors_by_message():
    read = startup.classify(LOG)
    assert read["lines"] == 7
    assert read["by_level"] == {"WARNING": 4, "ERROR": 1}
    assert read["messages"] == {
        "WARNING: Delay kernel timed out: measured time has sub-optimal accuracy.": 2,
        "ERROR: The byte size (N) exceeds the base limit (N)": 1,
        "WARNING: WARNING switchyard.service.api.server: stopped while loading the model": 1,
        "WARNING: UserWarning: Error reading persistent compilation cache entry": 1,
    }


def test_a_loaded_weights_line_is_found():
    line = "2026-11-27 INFO switchyard.progress: loading ck8b: done, 16.1 GB of 16.1 GB (100%), 751.6 MB/s in 21.4 s"
    assert startup.WEIGHTS_LOADED.search(line).group(0).endswith("in 21.4 s")


def test_a_warm_env_without_a_value_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        startup.main(["--warm-env", "CUDA_MODULE_LOADING", "--work", "/nonexistent/never-made"])
    assert stop.value.code == 2
    assert "--warm-env takes NAME=VALUE, got 'CUDA_MODULE_LOADING'" in capsys.readouterr().err
