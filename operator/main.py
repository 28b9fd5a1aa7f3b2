"""``switchyard operator``: run the kopf operator cluster-wide, with peering so that two replicas
(a rolling update, an HA pair) never reconcile the same DecodeService at once."""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peering", default=os.environ.get("SWITCHYARD_PEERING", "switchyard"),
                        help="ClusterKopfPeering object shared by the operator replicas (default %(default)s)")
    parser.add_argument("--standalone", action="store_true",
                        help="no peering: for a single replica or a local run")
    parser.add_argument("--priority", type=int, default=int(os.environ.get("SWITCHYARD_PRIORITY", "0")),
                        help="peering priority; the highest live replica handles resources")
    parser.add_argument("--replan-interval", type=float,
                        default=float(os.environ.get("SWITCHYARD_REPLAN_INTERVAL", "60")),
                        help="seconds between capacity checks of each DecodeService (default %(default)s)")
    parser.add_argument("--service-image", default=os.environ.get("SWITCHYARD_SERVICE_IMAGE"),
                        help="default image of switchyard serving pods")
    parser.add_argument("--trtllm-image", default=os.environ.get("SWITCHYARD_TRTLLM_IMAGE"),
                        help="default image of tensorrt-llm serving pods")
    parser.add_argument("--liveness", default=os.environ.get("SWITCHYARD_LIVENESS", "http://0.0.0.0:8080/healthz"),
                        help="kopf liveness endpoint for the operator Deployment's probe")


def config_from_args(args: argparse.Namespace):  # -> OperatorConfig (import kept lazy)
    import dataclasses

    from .handlers import OperatorConfig
    from .render import RenderConfig

    overrides = {k: v for k, v in {"switchyard_image": args.service_image,
                                   "trtllm_image": args.trtllm_image}.items() if v}
    return OperatorConfig(render=dataclasses.replace(RenderConfig(), **overrides),
                          replan_interval_s=args.replan_interval,
                          peering_name=None if args.standalone else args.peering)


def ensure_peering(kube, name: str) -> None:
    """Kopf needs the ClusterKopfPeering object to exist; create it on first start."""
    from .kube import ApiError

    try:
        kube.create({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}})
    except ApiError as err:
        if err.status != 409:
            raise


def run(args: argparse.Namespace) -> int:
    import asyncio

    import kopf

    from .handlers import register
    from .kube import Kube

    config = config_from_args(args)
    kube = Kube.from_environment()
    if config.peering_name:
        ensure_peering(kube, config.peering_name)
    registry = kopf.OperatorRegistry()
    register(registry, config, kube)
    asyncio.run(kopf.operator(
        registry=registry,
        clusterwide=True,
        standalone=config.peering_name is None,
        peering_name=config.peering_name,
        priority=args.priority,
        liveness_endpoint=args.liveness,
    ))
    return 0
