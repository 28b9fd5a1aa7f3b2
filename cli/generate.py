"""``switchyard generate``: stream a generation from a running service, then its per-token latencies."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from switchyard.cli.usage import not_negative, positive_seconds

if TYPE_CHECKING:
    from switchyard.service.api.client import StreamResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument("--target", default="localhost:8001", help="host:port of the service")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=None, help="0 = greedy (the default)")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--request-id", default="")
    parser.add_argument(
        "--no-prefix-cache", action="store_true", help="compute the whole prompt afresh, reusing no cached prefix"
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="deadline of the call in seconds")
    parser.add_argument("--rows", type=int, default=32, help="per-token rows to print (0 = all)")


def latency_report(result: StreamResult, rows: int = 0) -> str:
    """Per-token table (client-side arrival gaps, the server's step and batch size) and percentiles, all
    as this client saw them (tokenizing, the engine's queue, gRPC and the network included)."""
    import numpy as np

    gaps = result.gaps_ms
    lines = [
        f"request {result.request_id}: {len(gaps)} tokens, finish {result.finish_reason or '-'}, "
        f"prompt {result.input_tokens} tokens"
    ]
    if not gaps:
        return "\n".join(lines)
    lines.append(f"{'token':>6} {'gap ms':>9} {'step':>7} {'batch':>5}")
    indices = list(range(len(gaps)))
    if rows and len(indices) > rows:
        indices = [*indices[: rows // 2], -1, *indices[-(rows // 2) :]]
    for i in indices:
        if i < 0:
            lines.append(f"{'...':>6}")
            continue
        step = "prefill" if result.steps[i] < 0 else str(result.steps[i])
        lines.append(f"{i:>6} {gaps[i]:>9.3f} {step:>7} {result.batch_sizes[i]:>5}")
    lines.append(f"time to first token {gaps[0]:.3f} ms, as this client saw it (request sent -> first token received)")
    if len(gaps) > 1:
        rest = np.asarray(gaps[1:])
        p50, p90, p99 = np.percentile(rest, [50, 90, 99])
        lines.append(
            f"inter-token ms  p50 {p50:.3f}  p90 {p90:.3f}  p99 {p99:.3f}  ({1e3 / rest.mean():.1f} tokens/s)"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import grpc
    from switchyard.service.api.client import DecodeClient, make_request

    positive_seconds(args.timeout, "--timeout")
    not_negative(args.rows, "--rows")
    request = make_request(
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
        request_id=args.request_id,
        no_prefix_cache=args.no_prefix_cache,
    )

    shown = False

    def show(text: str) -> None:
        nonlocal shown
        shown = shown or bool(text)
        sys.stdout.write(text)
        sys.stdout.flush()

    with DecodeClient(args.target) as client:
        try:
            result = client.generate(request, timeout=args.timeout, on_text=show)
        except grpc.RpcError as err:
            if shown:  # end the text streamed so far; with none, there is no line to end
                sys.stdout.write("\n")
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    sys.stdout.write("\n\n")
    print(latency_report(result, args.rows))
    return 0
