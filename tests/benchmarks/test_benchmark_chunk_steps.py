"""benchmarks/chunk_steps.py: a run on the tiny preset on host devices, and its argument checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import scripts

chunk_steps = scripts.load("chunk_steps")


def run_script(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(scripts.BENCHMARKS / "chunk_steps.py"), *argv],
                          env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=600)


def test_chunk_and_decode_steps_on_the_tiny_preset(tmp_path):
    out = tmp_path / "chunk-steps.json"
    run = run_script("--cpu", "--preset", "tiny", "--batch-slots", "4", "--max-seq-len", "128", "--step-tokens", "16",
                     "--state", "2:16", "0:8", "--prompt", "40", "--repeats", "1", "--decode-steps", "3",
                     "--temperature", "0.8", "--top-p", "0.9", "--out", str(out))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "device", "date", "commit", "jax", "config", "rows"} <= set(result)
    assert result["device"].endswith("cpu") and result["config"]["step_tokens"] == 16
    assert result["config"]["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9}
    beside, alone = result["rows"]
    assert (beside["decoding"], beside["context"], alone["decoding"]) == (2, 16, 0)
    # 40 prompt tokens in chunks of 16 (nothing decodes beside the second prompt either: the tiny
    # engine's idle chunk is its whole 128-token table, and 40 tokens are fewer)
    assert beside["chunk_steps"] == alone["chunk_steps"] == 3
    assert beside["chunk_step_ms"] > 0 and beside["decode_step_ms"] > 0
    assert alone["decode_step_ms"] is None
    # the host's launch of each kind of step, timed apart from the step
    assert beside["chunk_launch_ms"] > 0 and beside["decode_launch_ms"] > 0 and alone["chunk_launch_ms"] > 0
    assert alone["decode_launch_ms"] is None


@pytest.mark.parametrize("argv, message", [
    (["--state", "20"], "a state is DECODING:CONTEXT"),
    (["--state=-1:8"], "DECODING >= 0"),
    (["--batch-slots", "4", "--state", "4:16"], "leave no slot"),
    (["--max-seq-len", "128", "--state", "2:100", "--prompt", "40"], "runs past --max-seq-len"),
    (["--repeats", "0"], "--repeats must be at least 1"),
    (["--temperature", "0.7", "--top-p", "0"], "top_p must be in (0, 1]"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        chunk_steps.parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]
