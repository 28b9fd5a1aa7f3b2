"""``switchyard generate`` and ``switchyard trace --target`` against a running service, and
``switchyard serve``'s configuration (flags, environment, the operator's layout file)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from helpers.serving_harness import serving
from switchyard.cli import generate as client_cli
from switchyard.cli import serve as serve_cli
from switchyard.cli import trace as trace_cli
from switchyard.cli.main import build_parser, main
from switchyard.cli.usage import UsageError
from switchyard.service.api.client import DecodeClient, StreamResult, make_request

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served():
    with serving() as s:
        yield s


def test_generate_streams_text_then_per_token_latencies(served, capsys) -> None:
    args = build_parser().parse_args(["generate", "--target", served.target, "Hello there", "--max-tokens", "12",
                                      "--request-id", "cli-1"])
    assert args._run(args) == 0
    out = capsys.readouterr().out
    with DecodeClient(served.target) as c:
        expected = c.generate(make_request("Hello there", max_tokens=12), timeout=60)
    text, report = out.split("\n\n", 1)
    assert text == expected.text
    assert f"request cli-1: {len(expected.token_ids)} tokens" in report
    assert "time to first token" in report and "inter-token ms  p50" in report
    first_row = report.splitlines()[2].split()
    assert first_row[0] == "0" and int(first_row[2]) >= 1  # made by the step that carried the prompt's last chunk


def test_generate_reports_a_bad_request(served, capsys) -> None:
    args = build_parser().parse_args(["generate", "--target", served.target, "hi", "--temperature", "-1"])
    assert args._run(args) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_trace_target_reads_the_service(served, tmp_path: Path, capsys) -> None:
    with DecodeClient(served.target) as c:
        rid = c.generate(make_request("trace over grpc", max_tokens=6, request_id="cli-trace"), timeout=60).request_id
    served.wait_recorded([rid])
    png = tmp_path / "t.png"
    args = build_parser().parse_args(["trace", "--target", served.target, "--request", rid, "--png", str(png)])
    assert args._run(args) == 0
    out = capsys.readouterr().out
    assert f"request {rid}" in out and "inter-token ms" in out and png.exists()
    args = build_parser().parse_args(["trace", "--target", served.target, "--request", "never-sent", "--png", ""])
    assert trace_cli.run(args) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_trace_needs_exactly_one_source(capsys) -> None:
    assert main(["trace"]) == 2
    assert capsys.readouterr().err.strip() == (
        "switchyard trace: error: give a trace FILE or --target host:port (one of them)")


def test_latency_report_percentiles() -> None:
    r = StreamResult(request_id="x", token_ids=[1, 2, 3, 4], sent=0.0, arrivals=[0.010, 0.012, 0.015, 0.019],
                     steps=[-1, 0, 1, 2], batch_sizes=[1, 2, 2, 1], finish_reason="length", input_tokens=3)
    report = client_cli.latency_report(r)
    assert "time to first token 10.000 ms" in report
    assert "p50 3.000" in report  # gaps after the first: 2, 3, 4 ms


def _serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_serve_configuration_flags_env_and_layout_file(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SWITCHYARD_PORT", "9100")
    monkeypatch.setenv("SWITCHYARD_BATCH_SLOTS", "16")
    args = _serve_args(["--tp", "2", "--model-path", "/models/x"])
    assert args.port == 9100
    layout = serve_cli.resolve_layout(args)
    assert (layout.tp, layout.batch_slots, layout.model_path) == (2, 16, "/models/x")
    # The operator's file wins for the fields it sets and leaves the rest to flags/env.
    file = tmp_path / "layout.json"
    file.write_text(json.dumps({"tp": 8, "strategy": "oneshot", "max_seq_len": 4096}))
    layout = serve_cli.resolve_layout(_serve_args(["--tp", "2", "--layout", str(file), "--batch-slots", "4"]))
    assert (layout.tp, layout.strategy, layout.max_seq_len, layout.batch_slots) == (8, "oneshot", 4096, 4)
    file.write_text(json.dumps({"tp": 8, "nonsense": 1}))
    with pytest.raises(UsageError, match="nonsense"):
        serve_cli.resolve_layout(_serve_args(["--layout", str(file)]))


def test_serve_without_a_model_says_how_to_give_one(monkeypatch, capsys) -> None:
    monkeypatch.delenv("SWITCHYARD_MODEL_PATH", raising=False)
    assert main(["serve"]) == 2
    assert "--model-path" in capsys.readouterr().err
