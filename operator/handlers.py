"""Kopf handlers: thin. They hand the object to :mod:`reconcile` and post the Events it returns.

* create / resume / spec update of a DecodeService → full reconcile (re-plan, apply, prune, status);
* timer → if the planned layout no longer fits the nodes (a node went away, GPUs got taken) re-plan,
  with ``Degraded=True CapacityLost``; if nothing was placed yet, try again (capacity may have come);
* events of owned StatefulSets → readyReplicas and the Ready/Degraded conditions;
* deletion needs no handler: every owned object carries an owner reference and the garbage
  collector removes it.

Kopf keeps its own bookkeeping in annotations (``switchyard.dev/...``), never in the status, whose
schema is strict.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import kopf

from . import reconcile as rec
from . import render
from .crd import GROUP, PLURAL, VERSION
from .kube import Kube


@dataclasses.dataclass(frozen=True)
class OperatorConfig:
    render: render.RenderConfig = dataclasses.field(default_factory=render.RenderConfig)
    replan_interval_s: float = 60.0
    peering_name: str | None = "switchyard"  # None: standalone (one replica, no peering)
    # How long a replica that stopped without saying so (killed, node lost) blocks the others.
    peering_lifetime_s: int = 60
    retry_delay_s: float = 5.0  # after an API error, kopf retries the reconcile this much later


def _post(body: Any, events: list[tuple[str, str, str]]) -> None:
    for etype, reason, message in events:
        if etype == "Warning":
            kopf.warn(body, reason=reason, message=message)
        else:
            kopf.info(body, reason=reason, message=message)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig, kube: Kube) -> None:
    """Register the handlers on ``registry``; ``kube`` is the client they write through."""

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        # Kopf connects exactly as our client does (in-cluster service account, else kubeconfig).
        return kopf.ConnectionInfo(**kube.connection())

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        # Bookkeeping in annotations: the status schema has no room for kopf's fields.
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="switchyard.dev")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix="switchyard.dev", key="last-handled-configuration")
        settings.persistence.finalizer = "switchyard.dev/operator"
        settings.posting.level = logging.INFO
        settings.watching.server_timeout = 300
        settings.watching.client_timeout = 330
        if config.peering_name:
            settings.peering.name = config.peering_name
            settings.peering.mandatory = True
            settings.peering.clusterwide = True
            settings.peering.lifetime = config.peering_lifetime_s
        else:
            settings.peering.standalone = True

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec", registry=registry)
    def reconcile(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        try:
            outcome = rec.reconcile(kube, body, config.render)
        except Exception as err:  # API trouble: kopf retries with back-off
            raise kopf.TemporaryError(f"reconcile failed: {err}", delay=config.retry_delay_s) from err
        logger.info("%s", outcome.plan.message if outcome.plan else outcome.status.get("layoutSummary"))
        _post(body, outcome.events)

    @kopf.timer(GROUP, VERSION, PLURAL, interval=config.replan_interval_s,
                initial_delay=config.replan_interval_s, registry=registry)
    def capacity(body: kopf.Body, logger: kopf.Logger, **_: Any) -> None:
        status = body.get("status") or {}
        if status.get("observedGeneration") != body["metadata"].get("generation"):
            return  # a spec change is pending: the change handlers own this object until it is planned
        fits, why = rec.current_layout_fits(kube, body)
        if fits:
            return
        placed_before = bool((body.get("status") or {}).get("layout"))
        degraded = ("CapacityLost", f"re-planned: {why}") if placed_before else None
        outcome = rec.reconcile(kube, body, config.render, degraded=degraded)
        changed = [k for k, v in outcome.actions.items() if v != "unchanged"]
        if placed_before or changed:
            logger.info("capacity check: %s", why)
            _post(body, [("Warning", "Replanned", why)] if placed_before else [])
            _post(body, outcome.events)

    @kopf.on.event("apps", "v1", "statefulsets", labels={"app.kubernetes.io/managed-by": render.MANAGED_BY},
                   registry=registry)
    def statefulset_changed(body: kopf.Body, **_: Any) -> None:
        meta = body.get("metadata", {})
        name = (meta.get("labels") or {}).get(render.SERVICE_LABEL)
        namespace = meta.get("namespace")
        if not name:
            return

        def readiness(ds: dict[str, Any]) -> dict[str, Any] | None:
            if "replicas" not in (ds.get("status") or {}):
                return None  # not planned yet
            owner = render.owner_from_body(ds)
            statefulsets = kube.list("StatefulSet", namespace, render.selector_string(owner))
            status = render.readiness_status(ds, statefulsets, rec.now())
            old = ds.get("status") or {}
            if status["readyReplicas"] == old.get("readyReplicas") and status["conditions"] == old.get("conditions"):
                return None
            return status

        written = kube.update_status("DecodeService", namespace, name, readiness)
        if written is None:
            return  # deleted (the garbage collector takes the rest), not planned yet, or nothing changed
        ds, status = written
        ready = next(c for c in status["conditions"] if c["type"] == "Ready")
        kopf.event(ds, type="Normal" if ready["status"] == "True" else "Warning", reason=ready["reason"],
                   message=ready["message"])
