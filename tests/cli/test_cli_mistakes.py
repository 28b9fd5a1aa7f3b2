"""Ordinary mistakes on the command line: each gets one line on stderr naming what is wrong, exit
status 2, no traceback, and is found before anything slow (the port opening, loading, compiling)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HELPERS
from helpers.cli_process import assert_one_line, switchyard
from helpers.serve_process import free_port

pytestmark = pytest.mark.timeout(300)
NODES = HELPERS / "kube" / "nodes-hgx.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny") / "tiny"
    done = switchyard("make-checkpoint", "--preset", "tiny", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "parameters" in done.stdout and " 0.00 " not in done.stdout, done.stdout
    return out


def _busy_port() -> tuple[socket.socket, int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s, s.getsockname()[1]


@pytest.mark.parametrize("argv, words", [
    (["serve", "--tiny", "--strategy", "fastest"], ["--strategy", "fastest", "auto"]),
    (["serve", "--tiny", "--batch-slots", "0"], ["--batch-slots", "at least 1"]),
    (["serve", "--tiny", "--tp", "0"], ["--tp"]),
    (["serve", "--tiny", "--layout", "/no/such/layout.json"], ["layout file", "does not exist"]),
    (["serve", "--model-path", "/no/such/model"], ["model folder", "/no/such/model", "does not exist"]),
    (["serve", "--tiny", "--tp", "64"], ["--tp 64", "must divide"]),
    (["serve", "--tiny", "--tp", "2"], ["--tp 2", "needs 2 devices", "sees 1",
                                         "XLA_FLAGS=--xla_force_host_platform_device_count=2"]),
    (["serve", "--tiny", "--max-seq-len", "100000"], ["--max-seq-len 100000", "2048"]),
    (["serve", "--tiny", "--trace-file", "/no/such/folder/t.jsonl"], ["--trace-file", "does not exist"]),
    (["serve", "--tiny", "--port", "70000"], ["--port"]),
    (["serve", "--tiny", "--kv-tokens", "100"], ["--kv-tokens", "multiple of 64", "got 100"]),
    (["serve", "--tiny", "--kv-tokens", "1024"], ["--kv-tokens (1024)", "full-length", "--max-seq-len (2048)"]),
    (["serve", "--tiny", "--kv-memory-fraction", "1.5"], ["--kv-memory-fraction", "(0, 0.95]", "1.5"]),
    (["serve", "--tiny", "--step-tokens", "250"], ["--step-tokens", "multiple of 16", "250"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--step-tokens", "8"], ["--step-tokens", "got 8"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--kv-memory-fraction", "0"],
     ["--kv-memory-fraction", "(0, 0.95]"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--replicas", "-1"], ["--replicas", "at least 0", "-1"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--pp", "0"], ["--pp", "at least 1", "got 0"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--concurrency", "0"], ["--concurrency", "at least 1"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--input-tokens", "-5"], ["--input-tokens", "-5"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--max-tpot-ms", "0"], ["--max-tpot-ms", "more than 0"]),
    (["plan", "--model", "llama3-8b", "--nodes", str(NODES), "--target-tokens-per-s", "nan"],
     ["--target-tokens-per-s", "more than 0", "nan"]),
    (["plan", "--model", "llama3-8b", "--nodes", "/no/such/nodes.yaml"], ["--nodes file", "does not exist"]),
    (["plan", "--model", "llama-3-9b", "--nodes", str(NODES)], ["llama-3-9b", "llama3-8b"]),
    (["make-checkpoint", "--preset", "llama3-9b", "--out", "/tmp/x"], ["--preset", "tiny"]),
    (["make-checkpoint", "--preset", "tiny", "--out", "/etc/hostname/sub"], ["--out", "cannot be written"]),
    (["trace"], ["FILE", "--target"]),
    (["trace", "/no/such/traces.jsonl", "--png", "/no/such/folder/t.png"], ["--png", "does not exist"]),
    (["trace", "/no/such/traces.jsonl", "--png", "", "--limit", "-2"], ["--limit", "0 or more", "-2"]),
    (["trace", "/no/such/traces.jsonl", "--png", "", "--rows", "-1"], ["--rows", "0 or more", "-1"]),
    (["generate", "hi", "--timeout", "0"], ["--timeout", "positive", "0.0"]),
    (["generate", "hi", "--timeout", "nan"], ["--timeout", "positive", "nan"]),
    (["generate", "hi", "--rows", "-3"], ["--rows", "0 or more", "-3"]),
    (["demo", "--max-tokens", "-1"], ["--max-tokens", "0 or more", "-1"]),
    (["demo", "--startup-timeout", "-5"], ["--startup-timeout", "positive", "-5"]),
    (["demo", "--png", "/no/such/folder/t.png"], ["--png", "does not exist"]),
])
def test_mistakes_get_one_line_and_exit_2(argv, words) -> None:
    assert_one_line(switchyard(*argv, env={"JAX_PLATFORMS": "cpu"}), *words)


def test_model_folder_problems_are_found_before_the_port_opens(model_dir: Path, tmp_path: Path) -> None:
    held, port = _busy_port()  # were the port opened first, this would fail differently
    with held:
        for missing in ("tokenizer.json", "config.json"):
            broken = tmp_path / f"no-{missing}"
            broken.mkdir()
            for f in model_dir.iterdir():
                if f.name != missing:
                    (broken / f.name).symlink_to(f)
            started = time.monotonic()
            done = switchyard("serve", "--model-path", str(broken), "--port", str(port), "--host", "127.0.0.1")
            assert_one_line(done, missing)
            assert time.monotonic() - started < 60  # no compile happened


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_a_port_in_use_is_one_line_before_anything_loads(host: str | None) -> None:
    held, port = _busy_port()
    with held:
        started = time.monotonic()
        done = switchyard("serve", "--tiny", "--port", str(port), *(["--host", host] if host else []),
                          env={"JAX_PLATFORMS": "cpu"})
        assert_one_line(done, "cannot listen", f":{port}", "in use")
        assert time.monotonic() - started < 60


def test_an_http_port_in_use_is_one_line_before_anything_loads() -> None:
    held, port = _busy_port()
    with held:
        started = time.monotonic()
        done = switchyard("serve", "--tiny", "--host", "127.0.0.1", "--port", "0", "--http-port", str(port),
                          env={"JAX_PLATFORMS": "cpu"})
        assert_one_line(done, "cannot listen", f":{port}", "--http-port", "in use")
        assert time.monotonic() - started < 60


def test_generate_against_no_server_is_one_line_and_no_output() -> None:
    port = free_port()  # nothing listens there once the socket is closed
    done = switchyard("generate", "--target", f"127.0.0.1:{port}", "hello")
    assert done.returncode == 1 and done.stdout == "", (done.returncode, done.stdout)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "UNAVAILABLE" in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_a_layout_file_with_a_bad_value_names_it(tmp_path: Path) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"batch_slots": -1}))
    assert_one_line(switchyard("serve", "--tiny", "--layout", str(layout)), "layout file", "batch_slots")


def test_a_layout_file_and_the_kv_flags_are_checked_together(tmp_path: Path) -> None:
    layout = tmp_path / "layout.json"
    layout.write_text(json.dumps({"kv_tokens": 1000}))
    assert_one_line(switchyard("serve", "--tiny", "--layout", str(layout)), "layout file", "kv_tokens",
                    "multiple of 64")
    # The file's context is longer than the pool the flag sets.
    layout.write_text(json.dumps({"max_seq_len": 4096}))
    assert_one_line(switchyard("serve", "--tiny", "--layout", str(layout), "--kv-tokens", "2048"),
                    "layout file", "--kv-tokens (2048)", "(4096)")
    assert_one_line(switchyard("serve", "--tiny", env={"SWITCHYARD_STEP_TOKENS": "24"}), "--step-tokens", "24")


def test_kv_and_step_flags_set_the_layout_and_the_layout_file_wins(monkeypatch, tmp_path: Path) -> None:
    import argparse

    from switchyard.cli import serve as serve_cli
    from switchyard.service.modelspec import ServingLayout

    def resolve(*argv: str) -> ServingLayout:
        parser = argparse.ArgumentParser()
        serve_cli.add_arguments(parser)
        return serve_cli.resolve_layout(parser.parse_args(list(argv)))

    for name in ("KV_TOKENS", "KV_MEMORY_FRACTION", "STEP_TOKENS"):
        monkeypatch.delenv(f"SWITCHYARD_{name}", raising=False)
    default = resolve()
    assert (default.kv_tokens, default.kv_memory_fraction, default.step_tokens) == (
        ServingLayout.kv_tokens, ServingLayout.kv_memory_fraction, ServingLayout.step_tokens)
    flags = resolve("--kv-tokens", "4096", "--kv-memory-fraction", "0.5", "--step-tokens", "512")
    assert (flags.kv_tokens, flags.kv_memory_fraction, flags.step_tokens) == (4096, 0.5, 512)
    monkeypatch.setenv("SWITCHYARD_STEP_TOKENS", "128")
    assert resolve().step_tokens == 128
    file = tmp_path / "layout.json"
    file.write_text(json.dumps({"kv_tokens": 8192, "step_tokens": 64}))
    both = resolve("--layout", str(file), "--kv-tokens", "4096", "--kv-memory-fraction", "0.5")
    assert (both.kv_tokens, both.kv_memory_fraction, both.step_tokens) == (8192, 0.5, 64)


def test_a_pipeline_stage_that_cannot_listen_exits_before_joining(tmp_path: Path) -> None:
    held, port = _busy_port()
    with held:
        layout = tmp_path / "layout.json"
        layout.write_text(json.dumps({"tp": 1, "pp": 2, "batch_slots": 2, "max_seq_len": 256,
                                      "coordinator": "127.0.0.1:1"}))
        started = time.monotonic()
        done = switchyard("serve", "--tiny", "--layout", str(layout), "--host", "127.0.0.1", "--port", str(port),
                          env={"SWITCHYARD_PIPELINE_STAGE": "0", "JAX_PLATFORMS": "cpu"})
        assert_one_line(done, "cannot listen", str(port))
        assert time.monotonic() - started < 60


def test_operator_without_its_extra_says_which_extra(tmp_path: Path) -> None:
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text("import sys\nsys.modules['kopf'] = None\n")  # as if kopf were not installed
    done = switchyard("operator", "--standalone", env={"PYTHONPATH": str(tmp_path)})
    assert_one_line(done, "'operator' extra", "pip install 'switchyard[operator]'")


def test_output_into_a_closed_pipe_ends_quietly() -> None:
    reader = subprocess.Popen([sys.executable, "-m", "switchyard.cli.main", "plan", "--model", "llama-3-8b",
                               "--nodes", str(NODES)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdout.close()  # like `| head -0`: the reader is gone before the first line
    _, err = reader.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()[-2000:]


def test_plan_takes_the_manifests_model_names() -> None:
    done = switchyard("plan", "--model", "llama-3-8b", "--nodes", str(NODES), "--objective", "latency")
    assert done.returncode == 0 and "Planned" in done.stdout, done.stderr[-2000:]


def test_ctrl_c_during_warm_up_stops_at_once() -> None:
    port = free_port()
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    environment.update(XLA_FLAGS="", JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "switchyard.cli.main", "serve", "--tiny", "--host", "127.0.0.1",
                             "--port", str(port), "--http-port", "0"], stderr=subprocess.PIPE, text=True,
                            env=environment)
    log = []
    try:
        for line in proc.stderr:
            log.append(line)
            if "listening on" in line:
                break
        time.sleep(1.0)  # into the compile
        proc.send_signal(2)  # SIGINT, as Ctrl-C sends it
        started = time.monotonic()
        code = proc.wait(60)
        log.append(proc.stderr.read())
    finally:
        proc.kill()
    text = "".join(log)
    if "serving tiny" in text.split("stopped while loading")[0] and code != 130:
        pytest.skip("warm-up finished before the signal")
    assert code == 130 and "stopped while loading the model" in text, text[-3000:]
    assert time.monotonic() - started < 10


HOSTILE_VALUES = [2**63 - 1, -(2**63), 0, -1, 1.5, 1e308, float("nan"), "32", True, None, [], {}]
SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta")


def test_plan_answers_any_config_json_within_a_second(tmp_path: Path, capsys) -> None:
    """Every field of a config.json set to each hostile value: `plan` answers (a plan, or one line and
    exit 2) within a second, in this process so that the time is the planner's, not Python's start."""
    from switchyard.cli.main import main

    base = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32}
    path = tmp_path / "config.json"
    slow = []
    for field in SHAPE_FIELDS:
        for value in HOSTILE_VALUES:
            path.write_text(json.dumps({**base, field: value}))
            start = time.perf_counter()
            code = main(["plan", "--model", str(path), "--nodes", str(NODES)])
            elapsed = time.perf_counter() - start
            err = capsys.readouterr().err
            assert code in (0, 2), (field, value, code, err)
            if code == 2:
                assert len(err.strip().splitlines()) == 1 and field in err, (field, value, err)
            if elapsed > 1.0:
                slow.append((field, value, round(elapsed, 2)))
    assert not slow, slow


def test_a_sliding_window_shorter_than_the_context_is_refused_in_one_line(tmp_path: Path) -> None:
    """Sliding-window attention is not implemented: a Mistral whose window is shorter than the
    context it would be served with is refused before the port opens; at the window's length it serves."""
    import argparse
    import dataclasses

    from switchyard.cli.serve import check_model
    from switchyard.service.engine.checkpoint import write_checkpoint
    from switchyard.service.modelspec import ServingLayout, preset

    folder = write_checkpoint(dataclasses.replace(preset("tiny-mistral"), sliding_window=1024), tmp_path / "mistral",
                              progress=False)
    assert_one_line(switchyard("serve", "--model-path", str(folder), "--max-seq-len", "2048"),
                    "--max-seq-len 2048", "sliding window of 1024 tokens", "at most 1024")
    args = argparse.Namespace(trace_file=None, compile_cache=None)
    spec, _ = check_model(ServingLayout(max_seq_len=1024), str(folder), args)
    assert (spec.model_type, spec.sliding_window) == ("mistral", 1024)
