"""Run the kopf operator cluster-wide, with peering so that two replicas (a rolling update, an HA
pair) never reconcile the same DecodeService at once."""

from __future__ import annotations

import asyncio
import logging

import kopf

from .handlers import OperatorConfig, register
from .kube import ApiError, Kube


def ensure_peering(kube: Kube, name: str) -> None:
    """Kopf needs the ClusterKopfPeering object to exist; create it on first start."""
    try:
        kube.create({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}})
    except ApiError as err:
        if err.status != 409:
            raise


def run_operator(config: OperatorConfig, *, priority: int, liveness: str, log_level: str) -> int:
    # Without a handler only warnings would reach `kubectl logs`: kopf logs through the logging module.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
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
        priority=priority,
        liveness_endpoint=liveness,
    ))
    return 0
