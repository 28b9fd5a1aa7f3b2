"""``switchyard operator``: its arguments; :mod:`switchyard.operator.runner` runs the kopf operator
cluster-wide, with peering so that two replicas (a rolling update, an HA pair) never reconcile the same
DecodeService at once."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peering", default=os.environ.get("SWITCHYARD_PEERING", "switchyard"),
                        help="ClusterKopfPeering object shared by the operator replicas (default %(default)s)")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering: for a single replica or a local run")
    parser.add_argument("--priority", type=priority, default=priority(os.environ.get("SWITCHYARD_PRIORITY", "random")),
                        help="peering priority; the highest live replica handles resources. 'random' "
                             "(default): a random one per start, so Deployment replicas never tie (kopf "
                             "freezes every replica that sees a peer of equal priority)")
    parser.add_argument("--replan-interval", type=float,
                        default=float(os.environ.get("SWITCHYARD_REPLAN_INTERVAL", "60")),
                        help="seconds between capacity checks of each DecodeService (default %(default)s)")
    parser.add_argument("--service-image", default=os.environ.get("SWITCHYARD_SERVICE_IMAGE"),
                        help="default image of switchyard serving pods")
    parser.add_argument("--trtllm-image", default=os.environ.get("SWITCHYARD_TRTLLM_IMAGE"),
                        help="default image of tensorrt-llm serving pods")
    parser.add_argument("--otlp-endpoint", default=os.environ.get("SWITCHYARD_OTLP_ENDPOINT", ""),
                        help="OTLP endpoint of serving pods whose DecodeService sets no spec.otlpEndpoint")
    parser.add_argument("--compile-cache-path", default=os.environ.get("SWITCHYARD_COMPILE_CACHE_PATH", ""),
                        help="absolute folder on each node where serving pods keep compiled step programs "
                             "between starts (a hostPath volume; empty, the default: none)")
    parser.add_argument("--log-level", default=os.environ.get("SWITCHYARD_LOG_LEVEL", "INFO"),
                        help="operator log level (kopf's handler and event messages are INFO)")
    parser.add_argument("--liveness", default=os.environ.get("SWITCHYARD_LIVENESS", "http://0.0.0.0:8080/healthz"),
                        help="kopf liveness endpoint for the operator Deployment's probe")


def priority(value: str) -> int:
    """An integer, or ``random``: replicas of one Deployment share their arguments, and kopf pauses
    every operator that sees a peer of the same priority, so each start draws its own."""
    if value == "random":
        import secrets

        return 1 + secrets.randbelow(2**31 - 2)
    return int(value)


def config_from_args(args: argparse.Namespace):  # -> OperatorConfig (import kept lazy)
    import dataclasses

    from switchyard.cli.usage import UsageError
    from switchyard.operator.handlers import OperatorConfig
    from switchyard.operator.render import RenderConfig

    folder = args.compile_cache_path
    if folder and (not folder.startswith("/") or any(c in folder for c in "\n\r\0")):
        raise UsageError(f"--compile-cache-path {folder!r} is not an absolute folder path (a folder on each node)")

    overrides = {k: v for k, v in {"switchyard_image": args.service_image,
                                   "trtllm_image": args.trtllm_image,
                                   "otlp_endpoint": args.otlp_endpoint,
                                   "compile_cache_path": args.compile_cache_path}.items() if v}
    return OperatorConfig(render=dataclasses.replace(RenderConfig(), **overrides),
                          replan_interval_s=args.replan_interval,
                          peering_name=None if args.standalone else args.peering)


def run(args: argparse.Namespace) -> int:
    from switchyard.operator.runner import run_operator

    return run_operator(config_from_args(args), priority=args.priority, liveness=args.liveness,
                        log_level=args.log_level)
