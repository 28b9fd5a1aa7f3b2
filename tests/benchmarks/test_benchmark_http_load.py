"""benchmarks/http_load.py: its per-request statistics and the reading of guidellm's report on hand-made
records, its refusals, and a run on the tiny preset on CPU: `switchyard serve`, load.py's gRPC client
and guidellm through /v1/completions, every request answered with exactly its output length."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import scripts

pytestmark = pytest.mark.timeout(900)
http_load = scripts.load("http_load")


def record(ttft: float, itl: float | None, tokens: int, asked: int, start: float, end: float) -> dict:
    return {"ttft_ms": ttft, "itl_ms": itl, "tokens": tokens, "asked": asked, "start_s": start, "end_s": end}


def test_request_statistics_over_hand_made_records() -> None:
    records = [record(10, 2.0, 4, 4, 0.0, 1.0), record(30, 4.0, 8, 8, 0.5, 2.0), record(20, None, 1, 1, 1.0, 1.5)]
    row = http_load.request_stats(records)
    # TTFTs 10, 20, 30 -> p50 20, p99 at 1.98 -> 29.8; ITLs 2, 4 (the one-token request has none)
    assert row == {"output_tokens": 13, "exact_lengths": True, "ttft_ms_p50": 20.0, "ttft_ms_p99": 29.8,
                   "itl_ms_p50": 3.0, "itl_ms_p99": 3.98, "output_tokens_per_s": 6.5}
    records[1]["tokens"] = 7  # stopped short of what it asked for
    assert http_load.request_stats(records)["exact_lengths"] is False


def test_grpc_results_become_records_of_finished_requests() -> None:
    wire = [(0.0, "a", 4), (0.1, "b", 1), (0.2, "c", 4)]
    measured = [
        {"arrival": 1.0, "token_times": [1.02, 1.03, 1.05], "tokens": 4, "status": "finished"},  # 2 tokens in one
        {"arrival": 1.1, "token_times": [1.15], "tokens": 1, "status": "finished"},
        {"arrival": 1.2, "token_times": [], "tokens": 0, "status": "failed"},
    ]
    first, one = http_load.grpc_records(measured, wire)
    assert first["ttft_ms"] == pytest.approx(20) and first["itl_ms"] == pytest.approx(10)  # 30 ms over 3 gaps
    assert (first["tokens"], first["asked"], first["end_s"]) == (4, 4, 1.05)
    assert one["itl_ms"] is None and one["ttft_ms"] == pytest.approx(50)


def guidellm_report(bodies: list[dict], targeted: list[float] | None = None) -> dict:
    """guidellm's report of ``bodies``, each targeted at 100 s plus its prompt's planned offset unless
    ``targeted`` says otherwise."""
    planned = {"one": 100.0, "two": 100.3}
    targeted = targeted or [planned.get(body["prompt"], 100.0) for body in bodies]
    requests = [{"request_args": json.dumps({"body": body}), "time_to_first_token_ms": 12.0,
                 "inter_token_latency_ms": 3.0, "output_tokens": body["max_tokens"],
                 "info": {"timings": {"request_start": 5.0, "last_token_iteration": 6.0, "targeted_start": start}}}
                for body, start in zip(bodies, targeted, strict=True)]
    return {"benchmarks": [{"requests": {"successful": requests},
                            "metrics": {"request_totals": {"successful": len(bodies), "errored": 0, "incomplete": 1,
                                                           "total": len(bodies) + 1}}}]}


def test_guidellms_report_is_read_against_the_plan() -> None:
    wire = [(0.0, "one", 4), (0.3, "two", 8)]
    bodies = [{"prompt": "two", "max_tokens": 8, "ignore_eos": True}, {"prompt": "one", "max_tokens": 4,
                                                                        "ignore_eos": True}]
    records, totals = http_load.guidellm_records(guidellm_report(bodies), wire)
    assert sorted(r["asked"] for r in records) == [4, 8] and totals["incomplete"] == 1
    assert records[0] == record(12.0, 3.0, 8, 8, 5.0, 6.0)
    for wrong in ({"prompt": "two", "max_tokens": 9, "ignore_eos": True}, {"prompt": "two", "max_tokens": 8},
                  {"prompt": "three", "max_tokens": 8, "ignore_eos": True}):
        with pytest.raises(SystemExit, match="did not send a planned prompt"):
            http_load.guidellm_records(guidellm_report([wrong]), wire)
    with pytest.raises(SystemExit, match="did not replay the planned arrivals"):  # each sent at the other's time
        http_load.guidellm_records(guidellm_report(bodies, targeted=[100.0, 100.3]), wire)


def test_the_comparison_holds_http_against_grpc_at_each_rate() -> None:
    def row(path: str, rate: float, ttft: float, itl: float) -> dict:
        return {"path": path, "rate_rps": rate, "ttft_ms_p50": ttft, "itl_ms_p50": itl}

    rows = [row("grpc", 8, 100.0, 5.0), row("http", 8, 109.0, 5.2), row("grpc", 12, 100.0, 5.0),
            row("http", 12, 111.0, 5.0), row("grpc", 16, 100.0, 5.0)]
    assert http_load.comparison(rows) == [
        {"rate_rps": 8, "ttft_ms_p50_added": 9.0, "itl_p50_added_fraction": 0.04, "targets_met": True},
        {"rate_rps": 12, "ttft_ms_p50_added": 11.0, "itl_p50_added_fraction": 0.0, "targets_met": False},
    ]


def run_script(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(scripts.BENCHMARKS / "http_load.py"), *argv],
                          env=dict(os.environ, PYTHONSAFEPATH="1", JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=timeout)


def test_prompt_texts_encode_again_to_about_their_drawn_lengths(tmp_path: Path) -> None:
    """On the 8B preset's tokenizer, whose ids past the few learned ones are reserved fillers (each
    decodes to markup that encodes as a dozen tokens), a text of n drawn tokens is still about n
    tokens to the server."""
    import numpy as np
    from switchyard.service.engine.tokenizer import build_tokenizer
    from switchyard.service.modelspec import preset

    path = tmp_path / "tokenizer.json"
    build_tokenizer(preset("llama3-8b")).save(str(path))
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    lengths = [128, 1024, 3072]
    texts = http_load.prompt_texts(path, lengths, np.random.default_rng(0))
    for n, text in zip(lengths, texts, strict=True):
        assert 0.8 * n <= len(tokenizer.encode(text, add_special_tokens=False).ids) <= 1.2 * n


def test_each_path_gets_the_same_arrivals_and_lengths_with_texts_of_its_own(tiny_checkpoint_dir: Path) -> None:
    """A path must not find its prompts in the prefix cache the path before it filled."""
    args = http_load.parse_args(["--preset", "tiny", "--max-seq-len", "128", "--prompt-lengths", "8", "32",
                                 "--output-lengths", "4", "8"])
    tokenizer = tiny_checkpoint_dir / "tokenizer.json"
    grpc, http = (http_load.plan(6, 3, args, tokenizer, 5, path) for path in ("grpc", "http"))
    assert len(grpc) == len(http) > 3
    assert [(offset, out) for offset, _, out in grpc] == [(offset, out) for offset, _, out in http]
    assert all(a != b for (_, a, _), (_, b, _) in zip(grpc, http, strict=True))
    assert grpc == http_load.plan(6, 3, args, tokenizer, 5, "grpc")
    # A path's second attempt (its client sent fewer than planned): the same schedule, texts none has sent.
    again = http_load.plan(6, 3, args, tokenizer, 5, "http", attempt=1)
    assert [(offset, out) for offset, _, out in again] == [(offset, out) for offset, _, out in http]
    assert not {text for _, text, _ in again} & {text for _, text, _ in grpc + http}


def test_server_means_are_taken_over_what_the_histograms_observed_between_scrapes() -> None:
    names = http_load.SERVER_HISTOGRAMS
    before = {names["ttft_ms_mean"]: (1.0, 10), names["itl_ms_mean"]: (2.0, 100), names["step_ms_mean"]: (0.0, 0)}
    after = {names["ttft_ms_mean"]: (1.5, 15), names["itl_ms_mean"]: (2.6, 200), names["step_ms_mean"]: (0.0, 0)}
    assert http_load.server_means(before, after) == {"ttft_ms_mean": 100.0, "itl_ms_mean": 6.0, "step_ms_mean": None}


def test_mistakes_are_one_line_before_anything_starts(tmp_path: Path) -> None:
    done = run_script("--guidellm", str(tmp_path / "no-guidellm"), "--work", str(tmp_path))
    assert done.returncode != 0 and "cannot run guidellm" in done.stderr and "Traceback" not in done.stderr
    done = run_script("--prompt-lengths", "4000", "--output-lengths", "512", "--max-seq-len", "4352")
    assert done.returncode == 2 and "exceed --max-seq-len 4352" in done.stderr
    assert not (tmp_path / "serve.log").exists()


def test_a_run_on_the_tiny_preset_through_both_paths(tmp_path: Path) -> None:
    if shutil.which("guidellm", path=str(Path(sys.executable).parent)) is None:
        pytest.fail("guidellm is not installed beside this Python: pip install -e '.[dev]'")
    out = tmp_path / "http-load.json"
    done = run_script("--preset", "tiny", "--batch-slots", "4", "--max-seq-len", "128", "--rates", "4",
                      "--duration", "2", "--prompt-lengths", "8", "16", "--output-lengths", "4", "8",
                      "--client-workers", "2", "--work", str(tmp_path / "work"), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["targets"]["rate_rps"] == 8
    grpc, http = result["rows"]
    assert (grpc["path"], http["path"]) == ("grpc", "http")
    assert grpc["sent"] == http["sent"] > 0  # the same requests on both paths
    assert grpc["attempts"] == 1 and 1 <= http["attempts"] <= http_load.CLIENT_ATTEMPTS
    for row in (grpc, http):
        assert row["finished"] == row["sent"] and row["failed"] == row["unfinished"] == 0, row
        assert row["exact_lengths"] and row["output_tokens"] == grpc["output_tokens"]  # ignore_eos on both
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and 0 < row["itl_ms_p50"] <= row["itl_ms_p99"]
        assert all(row["server"][key] > 0 for key in http_load.SERVER_HISTOGRAMS), row["server"]
    report = http["client_report"]
    assert report["guidellm_version"] == http_load.GUIDELLM_VERSION and report["ttft_ms_p50"] > 0
    (compared,) = result["comparison"]
    assert compared["rate_rps"] == 4 and isinstance(compared["targets_met"], bool)
    # guidellm's own report and the requests it sent are kept beside serve's log.
    sent = [json.loads(line) for line in (tmp_path / "work" / "rate-4-prompts.jsonl").read_text().splitlines()]
    assert len(sent) == http["sent"] and {s["output_tokens_count"] for s in sent} <= {4, 8}
    assert (tmp_path / "work" / "rate-4-guidellm.json").exists() and (tmp_path / "work" / "serve.log").exists()
