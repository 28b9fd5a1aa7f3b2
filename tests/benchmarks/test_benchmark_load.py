"""benchmarks/load.py: its statistics on hand-made token times, the length-mix parser, seeded Poisson
arrivals, and a run of the script on the tiny preset on host devices through both paths."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import scripts

load = scripts.load("load")

TTFT_S, ITL_S = 0.5, 0.020


def req(arrival: float, times: list[float], status: str = "finished", reason: str = "length"):
    return load.RequestTimes(arrival, times, status, reason)


# ---- statistics ----------------------------------------------------------------------------------

MEETS = req(0.0, [0.1, 0.11, 0.12, 0.13])  # TTFT 100 ms, gaps 10 ms
LATE = req(1.0, [1.7, 1.71, 1.72])  # misses by TTFT: 700 ms
JITTERY = req(2.0, [2.2, 2.21, 2.26])  # misses by inter-token p99: gaps 10, 50 ms -> p99 49.6 ms
ONE_TOKEN = req(3.0, [3.05])  # no gap: meets
NEVER_STARTED = req(3.5, [], "unfinished", "timeout")


def test_percentile_interpolates_between_ranks_like_numpy():
    values = [0.3, 0.1, 0.7, 0.2, 0.05]
    for p in (0, 1, 50, 90, 99, 100):
        assert load.percentile(values, p) == pytest.approx(float(np.percentile(values, p)), abs=1e-15)
    assert load.percentile([0.1, 0.2, 0.3, 0.4], 50) == pytest.approx(0.25)
    assert load.percentile([], 50) is None


def test_each_request_meets_or_misses_the_slo_for_its_own_reason():
    assert load.meets_slo(MEETS, TTFT_S, ITL_S)
    assert not load.meets_slo(LATE, TTFT_S, ITL_S)
    assert load.meets_slo(LATE, 0.7, ITL_S)  # the bound is inclusive
    assert not load.meets_slo(JITTERY, TTFT_S, ITL_S)
    assert load.meets_slo(JITTERY, TTFT_S, 0.0497)  # its own p99: 10 + 0.99 * 40 = 49.6 ms
    assert load.meets_slo(ONE_TOKEN, TTFT_S, ITL_S)
    assert not load.meets_slo(NEVER_STARTED, TTFT_S, ITL_S)
    # good times do not count for a request that did not finish, or failed
    assert not load.meets_slo(req(0.0, [0.1, 0.11], "unfinished", "timeout"), TTFT_S, ITL_S)
    assert not load.meets_slo(req(0.0, [0.1, 0.11], "failed", "error"), TTFT_S, ITL_S)


def test_summary_of_hand_made_token_times():
    row = load.summarize([MEETS, LATE, JITTERY, ONE_TOKEN, NEVER_STARTED], TTFT_S, ITL_S)
    # TTFTs 100, 700, 200, 50 ms -> sorted 50, 100, 200, 700: p50 at 1.5 -> 150, p99 at 2.97 -> 200 + 0.97 * 500
    # gaps 10 x6 and 50 ms: p50 10, p99 at 5.94 -> 10 + 0.94 * 40 = 47.6, max 50
    # 11 tokens over 0.0 (first arrival) .. 3.05 (last token); MEETS and ONE_TOKEN meet the SLO
    want = {
        "sent": 5, "finished": 4, "failed": 0, "unfinished": 1, "stopped_early": 0,
        "ttft_ms_p50": 150.0, "ttft_ms_p99": 685.0,
        "itl_ms_p50": 10.0, "itl_ms_p99": 47.6, "itl_ms_max": 50.0,
        "output_tokens": 11, "span_s": 3.05, "output_tokens_per_s": round(11 / 3.05, 3),
        "slo_met_requests": 2, "goodput_rps": round(2 / 3.05, 4), "slo_p99s_hold": False,
    }
    assert row.keys() == want.keys()
    for key, value in want.items():
        assert row[key] == pytest.approx(value, abs=1e-9), key


def test_ttft_and_queueing_per_prompt_length():
    short = [load.RequestTimes(0.0, [0.1, 0.2], prompt_tokens=128, first_chunk=0.05),
             load.RequestTimes(1.0, [1.3], prompt_tokens=128, first_chunk=1.2)]
    long = [load.RequestTimes(2.0, [2.5], prompt_tokens=3072)]  # no chunk time (the gRPC path)
    never = [load.RequestTimes(3.0, [], "unfinished", prompt_tokens=64)]
    rows = load.by_prompt_length(long + short + never)
    assert rows == [
        {"prompt_tokens": 128, "requests": 2, "ttft_ms_p50": 200.0, "ttft_ms_p99": 298.0,
         "queued_ms_p50": 125.0, "queued_ms_p99": 198.5},
        {"prompt_tokens": 3072, "requests": 1, "ttft_ms_p50": 500.0, "ttft_ms_p99": 500.0},
    ]
    # more lengths than MAX_LENGTH_GROUPS: doubling buckets named by their upper bound
    many = [load.RequestTimes(0.0, [0.01 * n], prompt_tokens=n) for n in range(1, load.MAX_LENGTH_GROUPS + 2)]
    buckets = load.by_prompt_length(many)
    assert [r["prompt_tokens"] for r in buckets] == [1, 2, 4, 8, 16]
    assert [r["requests"] for r in buckets] == [1, 1, 2, 4, 5]  # 1 | 2 | 3-4 | 5-8 | 9-13
    assert buckets[-1]["ttft_ms_p50"] == pytest.approx(110.0)


def test_the_p99s_hold_only_when_every_request_finished_within_both_bounds():
    assert load.summarize([MEETS, ONE_TOKEN], TTFT_S, ITL_S)["slo_p99s_hold"]
    assert not load.summarize([MEETS, ONE_TOKEN, NEVER_STARTED], TTFT_S, ITL_S)["slo_p99s_hold"]
    assert not load.summarize([MEETS, ONE_TOKEN, req(0.0, [0.1], "failed", "error")], TTFT_S, ITL_S)["slo_p99s_hold"]
    assert not load.summarize([MEETS, ONE_TOKEN, LATE], TTFT_S, ITL_S)["slo_p99s_hold"]  # TTFT p99
    assert not load.summarize([MEETS, ONE_TOKEN, JITTERY], TTFT_S, ITL_S)["slo_p99s_hold"]  # pooled ITL p99
    stopped = load.summarize([MEETS, req(0.0, [0.2, 0.21], "finished", "stop")], TTFT_S, ITL_S)
    assert stopped["stopped_early"] == 1 and stopped["finished"] == 2 and stopped["output_tokens"] == 6
    empty = load.summarize([NEVER_STARTED], TTFT_S, ITL_S)
    assert empty["ttft_ms_p99"] is None and empty["output_tokens_per_s"] is None and not empty["slo_p99s_hold"]


def test_highest_rate_where_the_p99s_hold_per_path():
    rows = [{"path": "grpc", "rate_rps": 4.0, "slo_p99s_hold": True},
            {"path": "grpc", "rate_rps": 8.0, "slo_p99s_hold": True},
            {"path": "grpc", "rate_rps": 12.0, "slo_p99s_hold": False},
            {"path": "in-process", "rate_rps": 4.0, "slo_p99s_hold": False}]
    assert load.highest_rate_holding(rows, "grpc") == 8.0
    assert load.highest_rate_holding(rows, "in-process") is None


# ---- length mixes --------------------------------------------------------------------------------


def test_length_mix_forms(tmp_path):
    rng = np.random.default_rng(0)
    fixed = load.parse_length_mix(["128", "256", "3072"])
    assert fixed.choices == (128, 256, 3072) and (fixed.shortest, fixed.longest) == (128, 3072)
    assert set(fixed.draw(rng, 300)) == {128, 256, 3072}
    span = load.parse_length_mix(["uniform:2:5"])
    assert (span.shortest, span.longest) == (2, 5)
    assert set(span.draw(rng, 300)) == {2, 3, 4, 5}  # both ends included
    lines, listed = tmp_path / "lines.txt", tmp_path / "list.json"
    lines.write_text("16\n\n32\n 64 \n")
    listed.write_text("[7, 9]")
    assert load.parse_length_mix([f"file:{lines}"]).choices == (16, 32, 64)
    assert load.parse_length_mix([f"file:{listed}"]).choices == (7, 9)


@pytest.mark.parametrize(("spec", "message"), [
    ([], "no lengths given"),
    (["12", "abc"], "'abc' is not an integer length"),
    (["0"], "at least 1"),
    (["uniform:5:2"], "LO 5 is above HI 2"),
    (["uniform:3"], "expected uniform:LO:HI"),
    (["uniform:1:x"], "'x' is not an integer length"),
    (["uniform:1:4", "8"], "takes no other values"),
    (["file:"], "expected file:PATH"),
    (["file:/nonexistent/lengths.txt"], "cannot read"),
])
def test_length_mix_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        load.parse_length_mix(spec)


@pytest.mark.parametrize(("text", "message"), [
    ("", "no lengths"), ("[1, 2.5]", "integers only"), ("[1, true]", "integers only"), ("[1,", "not a JSON list"),
    ("8\nlots\n", "'lots' is not an integer length"), ("[3, -1]", "at least 1"),
])
def test_length_file_errors(tmp_path, text, message):
    path = tmp_path / "lengths"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load.parse_length_mix([f"file:{path}"])


def test_a_bad_length_flag_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        load.parse_args(["--prompt-lengths", "uniform:9:3"])
    assert exit_.value.code == 2
    assert "LO 9 is above HI 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load.parse_args(["--prompt-lengths", "3072", "--output-lengths", "2048", "--max-seq-len", "4096"])
    assert "do not fit --max-seq-len 4096" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        load.parse_args(["--prompt-lengths", "8", "16", "--shared-prefix", "9"])
    assert "--shared-prefix 9" in capsys.readouterr().err


# ---- arrivals and requests -----------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_have_the_asked_mean_rate():
    def arrivals(seed: int, rate: float = 10.0, duration: float = 1000.0) -> list[float]:
        return load.poisson_arrivals(rate, duration, np.random.default_rng(seed))

    first = arrivals(1)
    assert first == arrivals(1) and first != arrivals(2)
    assert all(0 < a < b < 1000.0 for a, b in itertools.pairwise(first))
    for seed in range(5):  # ~10,000 arrivals each: the count's standard deviation is 1 %
        assert len(arrivals(seed)) == pytest.approx(10_000, rel=0.04)
    gaps = np.diff(first)
    assert gaps.mean() == pytest.approx(0.1, rel=0.04)
    assert gaps.std() == pytest.approx(0.1, rel=0.06)  # exponential: the deviation equals the mean
    with pytest.raises(ValueError, match="positive"):
        load.poisson_arrivals(0.0, 10.0, np.random.default_rng(0))


def test_planned_requests_share_their_prefix_and_avoid_special_tokens():
    mix = load.parse_length_mix(["8", "16"])
    kwargs = dict(vocab_size=12, avoid={4, 5}, shared_prefix=6, seed=3)
    plan = load.plan_requests(20.0, 5.0, mix, load.parse_length_mix(["uniform:1:3"]), **kwargs)
    assert plan == load.plan_requests(20.0, 5.0, mix, load.parse_length_mix(["uniform:1:3"]), **kwargs)
    assert 60 < len(plan) < 140
    assert {len(p.prompt_ids) for p in plan} == {8, 16} and {p.output_tokens for p in plan} == {1, 2, 3}
    assert len({tuple(p.prompt_ids[:6]) for p in plan}) == 1
    assert len({tuple(p.prompt_ids[6:]) for p in plan}) > 1
    assert all(3 <= t < 12 and t not in (4, 5) for p in plan for t in p.prompt_ids)


# ---- the script on host devices ------------------------------------------------------------------


def test_load_script_on_the_tiny_preset_through_both_paths(tmp_path):
    out = tmp_path / "load.json"
    argv = ["--cpu", "--preset", "tiny", "--rates", "20", "--duration", "1", "--prompt-lengths", "8", "16",
            "--output-lengths", "4", "8", "--path", "in-process", "grpc", "--max-seq-len", "64",
            "--batch-slots", "4", "--out", str(out)]
    run = subprocess.run([sys.executable, str(scripts.BENCHMARKS / "load.py"), *argv],
                         env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "device", "date", "config", "slo", "highest_rate_slo_p99s_hold", "rows",
            "warmup_s"} <= set(result)
    assert set(result["warmup_s"]) == {"in-process", "grpc"}  # each path's engine, the gRPC one in its own process
    assert all(seconds > 0 for seconds in result["warmup_s"].values())
    assert result["device"].endswith("cpu")
    assert result["config"]["weights"] and result["config"]["kv_cache"]  # the formats the engine served
    assert "p99 of its own inter-token gaps" in result["slo"]["request_meets"]
    from switchyard.service.modelspec import preset

    spec = preset("tiny")
    plan = load.plan_requests(20.0, 1.0, load.parse_length_mix(["8", "16"]), load.parse_length_mix(["4", "8"]),
                              vocab_size=spec.vocab_size, avoid={*spec.eos_token_ids, spec.bos_token_id},
                              shared_prefix=0, seed=0)
    want = sum(p.output_tokens for p in plan)
    rows = result["rows"]
    assert [(r["path"], r["rate_rps"]) for r in rows] == [("in-process", 20.0), ("grpc", 20.0)]
    summary_keys = set(load.summarize([MEETS], TTFT_S, ITL_S))
    for row in rows:
        on_grpc = row["path"] == "grpc"
        in_process_keys = {"generating", "engine_steps", "engine_steps_per_s", "host"}
        assert set(row) == {"path", "rate_rps", "by_prompt_length"} | summary_keys | (
            {"server_itl_ms_p99", "server_itl_ms_max"} if on_grpc else in_process_keys)
        if on_grpc:  # the gaps as the server emitted the tokens
            assert 0 <= row["server_itl_ms_p99"] <= row["server_itl_ms_max"]
        if not on_grpc:
            host = row["host"]
            assert row["engine_steps"] == host["decode_steps"] + host["chunk_steps"] > 0
            assert 4 * host["chunk_steps"] >= len(plan)  # every prompt took a chunk; at most four share a step
            assert host["chunk_launch_ms_mean"] > 0 and host["collect_wait_ms_mean"] >= 0
            assert 0 <= host["collect_found_done_fraction"] <= 1
            for kind in ("decode", "chunk"):  # every step counted at one width of the engine's
                assert sum(host[f"{kind}_step_widths"].values()) == host[f"{kind}_steps"]
                assert {int(w) for w in host[f"{kind}_step_widths"]} <= {1, 2, 4}
                p50, p99 = host[f"{kind}_device_ms_p50"], host[f"{kind}_device_ms_p99"]
                assert p50 is None or 0 < p50 <= p99
            assert 0 < host["chunk_launch_ms_mean"] <= host["chunk_launch_ms_p99"] <= host["chunk_launch_ms_max"]
            longest = host["longest_launches"]  # the longest first, the very longest the max of its kind
            times = [x["ms"] for x in longest]
            assert 0 < len(longest) <= 5 and times == sorted(times, reverse=True)
            top = longest[0]
            assert top["ms"] == host[f"{top['kind']}_launch_ms_max"]
            assert all((x["chunk_end"] > 0) == (x["kind"] == "chunk") and x["width"] in (1, 2, 4) for x in longest)
        groups = row["by_prompt_length"]
        assert [g["prompt_tokens"] for g in groups] == sorted({len(p.prompt_ids) for p in plan})
        assert sum(g["requests"] for g in groups) == len(plan)
        for g in groups:
            assert ("queued_ms_p50" in g) != on_grpc
            assert on_grpc or 0 <= g["queued_ms_p50"] <= g["ttft_ms_p50"]
        assert on_grpc or row["generating"] >= 1
        assert row["sent"] == row["finished"] == len(plan) > 0
        assert row["failed"] == row["unfinished"] == 0
        assert all(row[k] is not None and row[k] >= 0 for k in summary_keys if k != "slo_p99s_hold")
        assert row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["itl_ms_p50"] <= row["itl_ms_p99"] <= row["itl_ms_max"]
        assert row["output_tokens_per_s"] > 0
    for row in rows:  # ignore_eos on both paths: exact lengths
        assert row["output_tokens"] == want and row["stopped_early"] == 0, row["path"]
    table = run.stdout.strip().splitlines()[-2:]
    assert [line.split()[:2] for line in table] == [["in-process", "20"], ["grpc", "20"]]


def test_requests_cut_off_by_the_timeout_are_counted_and_a_cpu_run_without_out_writes_nothing(tmp_path):
    # ~20 requests of 200 tokens on one slot take seconds; the run waits 1 ms after the last arrival
    argv = ["--cpu", "--preset", "tiny", "--rates", "40", "--duration", "0.5", "--prompt-lengths", "8",
            "--output-lengths", "200", "--path", "in-process", "--max-seq-len", "224", "--batch-slots", "1",
            "--timeout", "0.001"]
    results = scripts.BENCHMARKS / "results" / "current"
    before = sorted(results.iterdir()) if results.exists() else []
    run = subprocess.run([sys.executable, str(scripts.BENCHMARKS / "load.py"), *argv], cwd=tmp_path,
                         env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "no file written" in run.stdout
    assert (sorted(results.iterdir()) if results.exists() else []) == before
    path, rate, sent, finished, failed, unfinished = run.stdout.strip().splitlines()[-1].split()[:6]
    assert (path, rate) == ("in-process", "40")
    assert int(unfinished) > 0 and int(failed) == 0 and int(sent) == int(finished) + int(unfinished)
    assert run.stdout.strip().splitlines()[-1].split()[-1] == "no"  # the p99s cannot hold with requests cut off


# ---- where the threads were during a stall -------------------------------------------------------


def test_stall_report_takes_the_longest_gaps_once_each_with_the_stacks_seen_during_them():
    sampler = load.StallSampler()
    sampler.stop()
    here = test_stall_report_takes_the_longest_gaps_once_each_with_the_stacks_seen_during_them.__code__
    other = load.summarize.__code__
    sampler.samples = [(t, {"scheduler": ((here, 10),), "loop": ((other, 20 if t < 1.5 else 21),)})
                       for t in (1.0, 1.1, 1.2, 1.9, 5.0)]
    sampler.collections = [(1.15, 1.17, 2, "scheduler"), (4.0, 4.01, 0, "loop")]
    # Two requests see the same stall (0.95-1.95 and 1.05-2.0), a third a shorter one; 0.01 s is below the bar.
    report = sampler.report([[0.95, 1.95, 1.96], [1.05, 2.0], [4.9, 5.5], [6.0, 6.01]], threshold_s=0.05)
    assert [r["gap_ms"] for r in report] == [1000.0, 600.0]
    stall, later = report
    assert stall["samples"] == 4 and stall["longest_without_sample_ms"] == 700.0
    assert stall["collections"] == [{"generation": 2, "ms": 20.0, "thread": "scheduler"}]
    scheduler, = stall["threads"]["scheduler"]
    assert scheduler["samples"] == 4 and here.co_name in scheduler["stack"][0]
    assert [s["samples"] for s in stall["threads"]["loop"]] == [3, 1]
    assert later["samples"] == 1 and later["collections"] == []
    assert sampler.report([[0.0, 0.01]], threshold_s=0.05) == []


def test_stall_sampler_sees_a_thread_where_it_waits():
    import threading
    import time

    release = threading.Event()

    def parked() -> None:
        release.wait(5)

    thread = threading.Thread(target=parked, name="parked")
    sampler = load.StallSampler()
    thread.start()
    start = time.monotonic()
    time.sleep(0.05)
    release.set()
    thread.join()
    sampler.stop()
    stall, = sampler.report([[start, time.monotonic()]], threshold_s=0.01)
    assert stall["samples"] > 5
    assert any("parked" in frame for s in stall["threads"]["parked"] for frame in s["stack"])
