"""``switchyard trace``: per-token traces from an OTLP-JSON file or a running service.

Prints a per-token table (one request, with the prefill chunks of its prompt) or a per-request table
(prompt tokens, those from the prefix cache, prefill chunks), TTFT and inter-token p50/p90/p99, the
slowest tokens with the engine step that made them, and, with ``--png PATH``, a PNG timeline that
marks the steps which carried each prompt. Its times are the engine's (from a request's arrival at the
scheduler to each token's emission), not a client's.
"""

from __future__ import annotations

import argparse
import sys

from switchyard.cli.usage import UsageError, not_negative, writable_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", help="OTLP-JSON lines file (switchyard serve --trace-file)")
    parser.add_argument("--target", help="host:port of a running service (its recent requests)")
    parser.add_argument("--request", default="", help="only this request id")
    parser.add_argument("--limit", type=int, default=0, help="only the last N requests (0 = all)")
    parser.add_argument("--png", metavar="PATH", help="also draw the timeline into this PNG file")
    parser.add_argument("--rows", type=int, default=40, help="per-token rows to print (0 = all)")
    parser.add_argument("--top", type=int, default=5, help="slowest tokens to list")


def run(args: argparse.Namespace) -> int:
    from switchyard.service.telemetry import traces as T

    if bool(args.file) == bool(args.target):
        raise UsageError("give a trace FILE or --target host:port (one of them)")
    for flag, value in (("--limit", args.limit), ("--rows", args.rows), ("--top", args.top)):
        not_negative(value, flag)
    if args.png:
        writable_file(args.png, "--png")
    if args.file:
        try:
            found = T.read_trace_file(args.file)
        except (OSError, ValueError) as err:
            print(f"error: cannot read {args.file}: {err}", file=sys.stderr)
            return 1
        if args.request:
            found = [t for t in found if t.request_id == args.request]
    else:
        import grpc
        from switchyard.service.api.client import DecodeClient

        with DecodeClient(args.target) as client:
            try:
                found = client.traces(args.request)
            except grpc.RpcError as err:
                print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
                return 1
    if args.limit:
        found = found[-args.limit :]
    if not found:
        what = f"request {args.request!r}" if args.request else "request traces"
        print(f"no {what} found", file=sys.stderr)
        return 1
    print(T.format_report(found, table_rows=args.rows, top=args.top))
    if args.png:
        from switchyard.service.telemetry.timeline import plot_timeline

        path = plot_timeline(found, args.png)
        print(f"timeline: {path}")
    return 0
