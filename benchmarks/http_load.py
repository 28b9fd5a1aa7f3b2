#!/usr/bin/env python3
"""HTTP streaming through an outside benchmark client (guidellm) beside the gRPC path, on one server.

``switchyard serve`` runs as a pod runs it (a subprocess on a checkpoint folder, gRPC and the
OpenAI-compatible HTTP API on their ports). For each rate (``--rates``, requests/s), the same requests
(seeded: arrival times, prompt lengths and output lengths; load.py's length-mix syntax) go each path,
with prompt texts of their own (random tokens of the drawn lengths): a path that sent the texts
another path had sent would find their KV in the server's prefix cache and skip their prefill.

- ``grpc``: through ``switchyard.v1.Decode/Generate`` with ``ignore_eos``, from this process
  (load.py's client: open-loop Poisson arrivals, one stream per request, the text as the prompt);
- ``http``: through ``POST /v1/completions`` with ``stream``, from guidellm (``guidellm run``, a
  process of its own, replaying the same arrival times: its ``replay`` profile over a JSON-lines file
  of prompts of the same lengths in the same order, each with its ``relative_timestamp``;
  ``max_tokens`` = the output length and ``ignore_eos``, as
  guidellm sends them for fixed-length outputs). A guidellm run that sent fewer requests than planned
  runs again with texts the server has not seen, at most ``CLIENT_ATTEMPTS`` times (``attempts``).

Both paths' figures are computed alike from their per-request records, as guidellm defines them:
``ttft_ms``, request start to first token; ``itl_ms``, a request's mean inter-token time,
(last token - first token) / (tokens - 1); p50 and p99 over requests (linear interpolation between the
nearest ranks). guidellm's own summary of its run sits beside them (``client_report``), and its whole
report in ``--work``. Targets at 8 req/s: HTTP adds <= 5 % to the inter-token p50 and <= 10 ms to the
TTFT p50 (``comparison``).

    python benchmarks/http_load.py --model-path /models/llama-3-8b --batch-slots 64 --max-seq-len 4352 \\
        --rates 8 --duration 20 --prompt-lengths 128 256 512 1024 2048 3072 --output-lengths 128
    python benchmarks/http_load.py --preset tiny --batch-slots 4 --max-seq-len 128 --rates 4 --duration 2 \\
        --prompt-lengths 8 16 --output-lengths 4 8 --out /tmp/http-load.json

Writes benchmarks/results/current/http-load-<device>.json ``{"command","device","date","commit","rows",...}``
(a run on CPU writes only to ``--out``, or prints only). Needs guidellm (the ``dev`` extra pins it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import runpy
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
GUIDELLM_VERSION = "0.8.1"  # the report format read here is this version's
PATHS = ("grpc", "http")
TARGET_RATE_RPS = 8.0
TARGET_TTFT_MS_P50_ADDED = 10.0
TARGET_ITL_P50_ADDED_FRACTION = 0.05
# guidellm 0.8.1 at times ends its replay before the last planned request has started (its report then
# says the dataset was not fully loaded): such a run is not the planned schedule, so it runs again.
CLIENT_ATTEMPTS = 3
ARRIVAL_SLACK_S = 0.001  # guidellm's targeted start times against the planned offsets


def sibling(name: str) -> SimpleNamespace:
    """Another benchmark script's functions (load.py: length mixes, arrivals, the gRPC client,
    percentiles; startup.py: ports, checkpoints, the device's name; result_file.py: provenance, writing)."""
    return SimpleNamespace(**runpy.run_path(str(HERE / name)))


load = sibling("load.py")
startup = sibling("startup.py")
result_file = sibling("result_file.py")


# ---- the requests ----------------------------------------------------------------------------------


def prompt_texts(tokenizer_file: Path, lengths: Sequence[int], rng: Any) -> list[str]:
    """Texts of random ordinary tokens, ``lengths[i]`` of them for text i (the server's tokenizer may
    count a few more or fewer once the text is encoded again). Ordinary: not special, and encoded
    again as itself; a random checkpoint's reserved filler ids
    decode to markup such as ``<|reserved_7|>``, which encodes again as a dozen tokens."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    special = set(tokenizer.get_added_tokens_decoder())
    vocab = tokenizer.get_vocab_size(with_added_tokens=False)
    candidates = [i for i in range(3, vocab) if i not in special]
    alone = tokenizer.decode_batch([[i] for i in candidates], skip_special_tokens=True)
    again = tokenizer.encode_batch(alone, add_special_tokens=False)
    ordinary = [i for i, encoded in zip(candidates, again, strict=True) if encoded.ids == [i]]
    if not ordinary:
        raise SystemExit(f"{tokenizer_file}: no token encodes again as itself")
    return [tokenizer.decode([ordinary[j] for j in rng.integers(0, len(ordinary), n)], skip_special_tokens=True)
            for n in lengths]


def plan(rate: float, duration: float, args: argparse.Namespace, tokenizer_file: Path,
         seed: int, path: str, attempt: int = 0) -> list[tuple[float, str, int]]:
    """(arrival offset, prompt text, output tokens) of one rate's requests on ``path``: arrivals and
    lengths from ``seed`` alone, the same on every path; the texts drawn for the path (and for a later
    ``attempt`` on it, texts the server has not seen)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    offsets = load.poisson_arrivals(rate, duration, rng)
    prompts = args.prompt_mix.draw(rng, len(offsets))
    outputs = args.output_mix.draw(rng, len(offsets))
    texts = prompt_texts(tokenizer_file, prompts,
                         np.random.default_rng([seed, PATHS.index(path), *([attempt] if attempt else [])]))
    return list(zip(offsets, texts, outputs, strict=True))


# ---- per-request records and their statistics ----------------------------------------------------


def request_stats(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The row figures of records ``{"ttft_ms", "itl_ms", "tokens", "asked", "end_s", "start_s"}``
    (``itl_ms`` None for a one-token request)."""
    ttfts = [r["ttft_ms"] for r in records if r["ttft_ms"] is not None]
    itls = [r["itl_ms"] for r in records if r["itl_ms"] is not None]
    tokens = sum(r["tokens"] for r in records)
    span = (max(r["end_s"] for r in records) - min(r["start_s"] for r in records)) if records else 0.0

    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 3)

    return {
        "output_tokens": tokens,
        "exact_lengths": all(r["tokens"] == r["asked"] for r in records),
        "ttft_ms_p50": rounded(load.percentile(ttfts, 50)),
        "ttft_ms_p99": rounded(load.percentile(ttfts, 99)),
        "itl_ms_p50": rounded(load.percentile(itls, 50)),
        "itl_ms_p99": rounded(load.percentile(itls, 99)),
        "output_tokens_per_s": round(tokens / span, 3) if span > 0 else None,
    }


def grpc_records(measured: Sequence[dict[str, Any]], wire: Sequence[tuple[float, str, int]]) -> list[dict[str, Any]]:
    """load.py's client's results (finished ones) as records: the arrival is the request's start."""
    out = []
    for m, (_, _, asked) in zip(measured, wire, strict=True):
        times = m["token_times"]
        if m["status"] != load.FINISHED or not times:
            continue
        n = m["tokens"]
        out.append({"ttft_ms": 1e3 * (times[0] - m["arrival"]),
                    "itl_ms": 1e3 * (times[-1] - times[0]) / (n - 1) if n > 1 else None,
                    "tokens": n, "asked": asked, "start_s": m["arrival"], "end_s": times[-1]})
    return out


def guidellm_records(report: dict[str, Any], wire: Sequence[tuple[float, str, int]]
                     ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """guidellm's successful requests as records (its own per-request figures; the output length
    asked is the one planned for the request's prompt), and its request counts. SystemExit when it
    sent a prompt not planned, without its max_tokens or ignore_eos, or not on the planned schedule
    (its targeted start times apart by other than the planned offsets, within ARRIVAL_SLACK_S)."""
    (bench,) = report["benchmarks"]
    asked = {text: out for _, text, out in wire}
    offsets = {text: offset for offset, text, _ in wire}
    records, origins = [], []
    for request in bench["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        if body.get("max_tokens") != asked.get(body.get("prompt")) or body.get("ignore_eos") is not True:
            raise SystemExit("guidellm did not send a planned prompt with its max_tokens and ignore_eos: "
                             f"{json.dumps(body)[:300]}")
        timings = request["info"]["timings"]
        origins.append(timings["targeted_start"] - offsets[body["prompt"]])
        records.append({"ttft_ms": request["time_to_first_token_ms"], "itl_ms": request["inter_token_latency_ms"],
                        "tokens": request["output_tokens"], "asked": body["max_tokens"],
                        "start_s": timings["request_start"], "end_s": timings["last_token_iteration"]})
    if origins and max(origins) - min(origins) > ARRIVAL_SLACK_S:
        raise SystemExit(f"guidellm did not replay the planned arrivals: its targeted starts are off the plan by "
                         f"up to {1e3 * (max(origins) - min(origins)):.1f} ms")
    totals = bench["metrics"]["request_totals"]
    return records, {k: int(v) for k, v in totals.items()}


def client_report(report: dict[str, Any]) -> dict[str, Any]:
    """guidellm's own summary: TTFT and inter-token p50 / p99 (ms) over its successful requests."""
    (bench,) = report["benchmarks"]
    metrics = bench["metrics"]

    def pct(name: str, p: str) -> float | None:
        value = metrics[name]["successful"]["percentiles"][p]
        return None if value is None else round(value, 3)

    return {"ttft_ms_p50": pct("time_to_first_token_ms", "p50"), "ttft_ms_p99": pct("time_to_first_token_ms", "p99"),
            "itl_ms_p50": pct("inter_token_latency_ms", "p50"), "itl_ms_p99": pct("inter_token_latency_ms", "p99"),
            "output_tokens_per_s": round(metrics["output_tokens_per_second"]["successful"]["mean"], 3),
            "guidellm_version": report["metadata"]["guidellm_version"]}


def comparison(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate measured on both paths: what HTTP adds to the TTFT p50 (ms) and to the inter-token p50
    (a fraction of gRPC's), against the targets."""
    out = []
    for rate in sorted({r["rate_rps"] for r in rows}):
        grpc = next((r for r in rows if r["rate_rps"] == rate and r["path"] == "grpc"), None)
        http = next((r for r in rows if r["rate_rps"] == rate and r["path"] == "http"), None)
        if grpc is None or http is None or None in (grpc["ttft_ms_p50"], http["ttft_ms_p50"]) \
                or not grpc["itl_ms_p50"] or http["itl_ms_p50"] is None:
            continue
        added_ms = round(http["ttft_ms_p50"] - grpc["ttft_ms_p50"], 3)
        added = round(http["itl_ms_p50"] / grpc["itl_ms_p50"] - 1, 4)
        out.append({"rate_rps": rate, "ttft_ms_p50_added": added_ms, "itl_p50_added_fraction": added,
                    "targets_met": added_ms <= TARGET_TTFT_MS_P50_ADDED and added <= TARGET_ITL_P50_ADDED_FRACTION})
    return out


# ---- the server and the two clients ----------------------------------------------------------------


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@contextlib.contextmanager
def serving(model: Path, args: argparse.Namespace) -> Iterator[SimpleNamespace]:
    """``switchyard serve`` on free ports until both its gRPC health and HTTP /health say serving;
    SIGTERM on the way out. Yields the targets and the served model's name."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port, http_port = startup.free_port(), startup.free_port()
    log_path = args.work / "serve.log"
    cmd = startup.switchyard("serve", "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "--http-port", str(http_port), "--tp", str(args.tp), "--batch-slots",
                             str(args.batch_slots), "--max-seq-len", str(args.max_seq_len), "--grace-period", "5",
                             *shlex.split(args.serve_args))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    target, url = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    try:
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
        deadline = time.monotonic() + args.start_timeout
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited {proc.returncode} while starting; log: {log_path}\n"
                                 + log_path.read_text(errors="replace")[-3000:])
            if time.monotonic() > deadline:
                raise SystemExit(f"serve was not serving after {args.start_timeout:g} s; log: {log_path}")
            with contextlib.suppress(grpc.RpcError, OSError):
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING and http_get(url + "/health")[0] == 200:
                    break
            time.sleep(0.2)
        model_name = json.loads(http_get(url + "/v1/models")[1])["data"][0]["id"]
        yield SimpleNamespace(target=target, url=url, model=model_name, proc=proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def guidellm_binary(given: str | None) -> str:
    """The guidellm executable: ``--guidellm``, else beside this Python, else on PATH; SystemExit
    (one line) when there is none or it is not the version whose report this reads."""
    beside = Path(sys.executable).with_name("guidellm")
    found = given or (str(beside) if beside.exists() else shutil.which("guidellm"))
    if not found:
        raise SystemExit(f"guidellm is not installed: pip install 'guidellm=={GUIDELLM_VERSION}' "
                         "(or pip install -e '.[dev]')")
    try:
        done = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=120)
    except OSError as err:
        raise SystemExit(f"cannot run guidellm {found!r}: {err.strerror or err}") from None
    version = done.stdout.strip().rpartition(" ")[2]
    if version != GUIDELLM_VERSION:
        raise SystemExit(f"{found} is guidellm {version or '(unknown)'}; this script reads {GUIDELLM_VERSION}'s "
                         f"report: pip install 'guidellm=={GUIDELLM_VERSION}'")
    return found


def run_guidellm(binary: str, server: SimpleNamespace, wire: Sequence[tuple[float, str, int]],
                 args: argparse.Namespace, tokenizer_dir: Path, name: str) -> dict[str, Any]:
    """One guidellm run of ``wire``'s prompts, each at its arrival time, through /v1/completions; its report."""
    data = args.work / f"{name}-prompts.jsonl"
    rows = ({"prompt": text, "output_tokens_count": out, "relative_timestamp": offset} for offset, text, out in wire)
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = args.work / f"{name}-guidellm.json"
    report.unlink(missing_ok=True)
    last = max(offset for offset, _, _ in wire)
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": server.url, "model": server.model,
                    "request_format": "/v1/completions", "stream": True, "http2": False,
                    "timeout": last + args.timeout},
        "profile": {"kind": "replay", "schedule_turn": "timestamp"},  # at each request's planned arrival
        "tokenizer": {"kind": "hf_auto", "model": str(tokenizer_dir)},
        "data": [{"kind": "json_file", "path": str(data)}],
        "constraints": [{"kind": "max_requests", "count": len(wire)},
                        {"kind": "max_duration", "seconds": last + args.timeout}],
        "seed": {"kind": "static", "value": args.seed},
        "outputs": [{"kind": "json", "path": str(report)}],
    }}
    scenario_file = args.work / f"{name}-scenario.json"
    scenario_file.write_text(json.dumps(scenario, indent=1) + "\n")
    env = dict(os.environ)
    if args.client_workers:
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(args.client_workers)
    log = args.work / f"{name}-guidellm.log"
    with open(log, "w") as out:
        done = subprocess.run([binary, "run", "--scenario", str(scenario_file), "--disable-console-interactive"],
                              stdout=out, stderr=subprocess.STDOUT, env=env, timeout=last + args.timeout + 600)
    if done.returncode != 0 or not report.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"guidellm exited {done.returncode}; its log: {log}\n{tail}")
    return json.loads(report.read_text())


def measure(path: str, rate: float, wire: list[tuple[float, str, int]], server: SimpleNamespace,
            args: argparse.Namespace, model: Path, binary: str | None) -> dict[str, Any]:
    if path == "grpc":
        measured = load.grpc_load(server.target, wire, args.timeout)
        records = grpc_records(measured, wire)
        failed = sum(m["status"] == load.FAILED for m in measured)
        row = {"client": "load.py gRPC (grpc.aio, one stream per request)", "sent": len(wire),
               "finished": len(records), "failed": failed, "unfinished": len(wire) - len(records) - failed}
    else:
        assert binary is not None
        report = run_guidellm(binary, server, wire, args, model, f"rate-{rate:g}")
        records, totals = guidellm_records(report, wire)
        row = {"client": f"guidellm {GUIDELLM_VERSION} (openai_http, /v1/completions, stream)",
               "sent": totals["total"], "finished": totals["successful"], "failed": totals["errored"],
               "unfinished": totals["incomplete"], "client_report": client_report(report)}
    return {"path": path, "rate_rps": rate, **row, **request_stats(records)}


# The server's own histograms (its /metrics), read before and after each path: their means over the
# path's requests tell an engine that ran slower from a path that delivered its tokens later.
SERVER_HISTOGRAMS = {"ttft_ms_mean": "switchyard_time_to_first_token_seconds",
                     "itl_ms_mean": "switchyard_inter_token_latency_seconds",
                     "step_ms_mean": "switchyard_engine_step_seconds"}


def scrape_sums(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each of SERVER_HISTOGRAMS on the server at ``url``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples if not sample.labels.keys() - {"model_name"}}
    return {name: (values.get(f"{name}_sum", 0.0), values.get(f"{name}_count", 0.0))
            for name in SERVER_HISTOGRAMS.values()}


def server_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """Each histogram's mean (ms) over what it observed between two scrapes (None: nothing observed)."""
    out: dict[str, Any] = {}
    for key, name in SERVER_HISTOGRAMS.items():
        total, count = (a - b for a, b in zip(after[name], before[name], strict=True))
        out[key] = round(1e3 * total / count, 3) if count > 0 else None
    return out


# ---- the run ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    startup.add_model_arguments(parser)
    parser.add_argument("--serve-args", default="", help="more `switchyard serve` flags, as one shell string")
    parser.add_argument("--rates", type=float, nargs="+", default=[TARGET_RATE_RPS], help="requests/s")
    parser.add_argument("--duration", type=float, default=20, help="seconds of arrivals per rate")
    parser.add_argument("--timeout", type=float, default=60, help="seconds to wait after the last arrival")
    parser.add_argument("--prompt-lengths", nargs="+", default=["128", "256", "512", "1024", "2048", "3072"],
                        help="prompt tokens: lengths drawn from uniformly, uniform:LO:HI or file:PATH")
    parser.add_argument("--output-lengths", nargs="+", default=["128"], help="output tokens, as --prompt-lengths")
    parser.add_argument("--path", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--guidellm", help="the guidellm executable (default: beside this Python, or on PATH)")
    parser.add_argument("--client-workers", type=int, default=0,
                        help="guidellm's worker processes (0: its default)")
    parser.add_argument("--start-timeout", type=float, default=900, help="seconds serve may take to serve")
    parser.add_argument("--work", type=Path, default=Path("/tmp/switchyard-http-load"),
                        help="folder for the checkpoint, serve's log and guidellm's files")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    try:
        args.prompt_mix = load.parse_length_mix(args.prompt_lengths)
        args.output_mix = load.parse_length_mix(args.output_lengths)
    except ValueError as err:
        parser.error(str(err))
    if any(rate <= 0 for rate in args.rates) or args.duration <= 0:
        parser.error("--rates and --duration must be positive")
    if args.prompt_mix.longest + args.output_mix.longest > args.max_seq_len:
        parser.error(f"the longest prompt and output ({args.prompt_mix.longest} + {args.output_mix.longest}) "
                     f"exceed --max-seq-len {args.max_seq_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = guidellm_binary(args.guidellm) if "http" in args.path else None
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model_path or args.work / f"model-{args.preset}"
    checkpoint = startup.make_checkpoint(args.preset, model) if args.model_path is None else {"path": str(model)}
    rows = []
    with serving(model, args) as server:
        print(f"serving {server.model} at {server.target} (gRPC) and {server.url} (HTTP)", flush=True)
        for index, rate in enumerate(args.rates):
            for path in args.path:
                for attempt in range(CLIENT_ATTEMPTS):
                    wire = plan(rate, args.duration, args, model / "tokenizer.json", args.seed + index, path, attempt)
                    if not wire:
                        raise SystemExit(f"no arrivals at {rate:g} req/s in {args.duration:g} s: raise --duration")
                    before = scrape_sums(server.url)
                    row = measure(path, rate, wire, server, args, model, binary)
                    row["server"] = server_means(before, scrape_sums(server.url))
                    row["attempts"] = attempt + 1
                    if row["sent"] == len(wire):
                        break
                    print(f"{path} {rate:g}/s: the client sent {row['sent']} of the {len(wire)} requests planned; "
                          "again, with prompt texts the server has not seen", flush=True)
                rows.append(row)
                print(f"{path:5} {rate:>6g}/s  sent {row['sent']:>4}  done {row['finished']:>4}  "
                      f"TTFT p50 {row['ttft_ms_p50']} ms  ITL p50 {row['itl_ms_p50']} ms  server means "
                      f"{row['server']}", flush=True)
    device = startup.device_name()
    result = {
        **result_file.provenance(device, argv, script=__file__),
        "config": {"model": str(args.model_path or args.preset), "checkpoint": checkpoint, "tp": args.tp,
                   "batch_slots": args.batch_slots, "max_seq_len": args.max_seq_len, "serve_args": args.serve_args,
                   "rates_rps": args.rates, "duration_s": args.duration, "timeout_s": args.timeout,
                   "prompt_lengths": args.prompt_lengths, "output_lengths": args.output_lengths, "seed": args.seed},
        "definitions": {
            "ttft_ms": "request start to its first token, per request",
            "itl_ms": "a request's mean inter-token time: (last token - first token) / (tokens - 1)",
            "percentiles": "over finished requests; linear interpolation between the nearest ranks",
            "client_report": "guidellm's own summary of the same run",
            "server": "the server's own /metrics histograms over the path's requests: means (ms) of TTFT (arrival "
                      "in the server to the first token), inter-token time (the engine's tokens of a request) and "
                      "engine step time",
        },
        "targets": {"rate_rps": TARGET_RATE_RPS, "ttft_ms_p50_added_max": TARGET_TTFT_MS_P50_ADDED,
                    "itl_p50_added_fraction_max": TARGET_ITL_P50_ADDED_FRACTION},
        "rows": rows,
        "comparison": comparison(rows),
    }
    out = args.out
    if out is None and device != "cpu":
        out = ROOT / "benchmarks" / "results" / "current" / f"http-load-{device.lower().replace(' ', '-')}.json"
    if out is not None:
        result_file.write_result(out, result, indent=1)
        print(f"wrote {out}")
    else:
        print("a run on CPU without --out: no file written")
    for c in result["comparison"]:
        print(f"{c['rate_rps']:g} req/s: HTTP adds {c['ttft_ms_p50_added']} ms to the TTFT p50 and "
              f"{100 * c['itl_p50_added_fraction']:.1f} % to the inter-token p50 (targets met: {c['targets_met']})")
    complete = all(r["finished"] == r["sent"] and r["exact_lengths"] for r in rows)
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
