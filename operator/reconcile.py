"""One reconcile of a DecodeService: fetch → inventory → plan → render → apply → prune → status.

Everything that decides is pure (spec, inventory, planner, render); this module only sequences the
fetches and writes through :class:`~switchyard.operator.kube.Kube`, and returns the Events to post.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping
from typing import Any

from . import inventory, planner, render
from . import spec as specmod
from .kube import CONFLICT_ATTEMPTS, ApiError, Kube

# Condition and Event reason when the API server refuses an object the operator renders.
OBJECT_REJECTED = "ObjectRejected"
# The API server's own words, cut to fit a condition message.
MAX_REJECTION_MESSAGE = 1000


@dataclasses.dataclass
class Outcome:
    plan: planner.Plan | None
    status: dict[str, Any]
    actions: dict[str, str]  # "Kind/name" -> created/updated/recreated/unchanged/deleted/rejected
    events: list[tuple[str, str, str]]  # (type Normal|Warning, reason, message)


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_inventory(kube: Kube, owner: render.Owner) -> inventory.Inventory:
    return inventory.build(kube.list("Node"), kube.list("Pod"),
                           ignore_pod_labels=render.selector(owner), ignore_namespace=owner.namespace)


def reconcile(kube: Kube, body: Mapping[str, Any], config: render.RenderConfig,
              degraded: tuple[str, str] | None = None) -> Outcome:
    owner = render.owner_from_body(body)
    spec = specmod.normalized(body["spec"])
    events: list[tuple[str, str, str]] = []
    try:
        source = specmod.model_source(spec)
        ref = specmod.config_map_ref(spec)
        data = None
        if ref is not None:
            cm = kube.get("ConfigMap", owner.namespace, ref[0])
            data = None if cm is None else (cm.get("data") or {})
        model = specmod.model_spec(spec, data)
    except specmod.SpecError as err:
        error, reason = str(err), err.kind.value
        status = {"observedGeneration": owner.generation, "replicas": 0, "layoutSummary": reason}
        status = write_status(kube, owner, lambda previous: {
            **status, "conditions": render.conditions_for(None, 0, owner.generation, previous, now(),
                                                          planning_error=(reason, error))})
        return Outcome(None, status, {}, [("Warning", reason, error)])

    inv = build_inventory(kube, owner)
    events += [("Warning", "BadNodeLabel", node.message) for node in inv.skipped]
    plan = planner.plan(model, inv, specmod.request(spec))
    objs = render.render(body, spec, plan, source, config)
    actions: dict[str, str] = {}
    refused: list[str] = []  # "Kind/name: the API server's message"
    for o in objs:
        key = f"{o['kind']}/{o['metadata']['name']}"
        try:
            actions[key] = kube.apply(o)
        except ApiError as err:
            if not err.refused:
                raise  # API trouble: the caller retries
            actions[key] = "rejected"
            refused.append(f"{key}: {err.message}")
    wanted = {(o["kind"], o["metadata"]["name"]) for o in objs}
    # Prune what an earlier plan rendered and this one does not (groups beyond dp, a pp change).
    for kind in ("StatefulSet", "ConfigMap"):
        for live in kube.list(kind, owner.namespace, render.selector_string(owner)):
            meta = live["metadata"]
            owned = any(ref.get("uid") == owner.uid for ref in meta.get("ownerReferences", []))
            if owned and (kind, meta["name"]) not in wanted:
                kube.delete(kind, owner.namespace, meta["name"])
                actions[f"{kind}/{meta['name']}"] = "deleted"

    lay = plan.layout
    statefulsets = []
    if lay is not None and lay.dp > 0:
        for name in render.group_names(owner, lay.pp, lay.dp):
            live = kube.get("StatefulSet", owner.namespace, name)
            if live is not None:
                statefulsets.append(live)
    ready = render.readiness(statefulsets, lay.pp if lay else 1)
    status = render.plan_status(plan, owner, config)
    dp = lay.dp if lay else 0
    status.update({"readyReplicas": ready, "ready": f"{ready}/{dp}"})
    if refused:
        # Sending the same object again is refused again: say so where people look, not in a retry loop.
        rejection = ("the API server refused " + "; ".join(refused))[:MAX_REJECTION_MESSAGE]
        degraded = (OBJECT_REJECTED, rejection)
        events.append(("Warning", OBJECT_REJECTED, rejection))
    write_status(kube, owner, lambda previous: {
        **status, "conditions": render.conditions_for(plan, ready, owner.generation, previous, now(),
                                                      degraded=degraded)})

    if lay is None:
        events.append(("Warning", plan.status, plan.message))
    else:
        events.append(("Normal" if plan.rejection is None else "Warning", plan.status, plan.message))
        changed = sorted(k for k, v in actions.items() if v not in ("unchanged", "rejected"))
        if changed:
            events.append(("Normal", "Applied", ", ".join(f"{k} {actions[k]}" for k in changed)[:1000]))
    return Outcome(plan, status, actions, events)


def write_status(kube: Kube, owner: render.Owner, build: Callable[[list[dict[str, Any]]], dict[str, Any]],
                 attempts: int = CONFLICT_ATTEMPTS) -> dict[str, Any]:
    """Write a status built from the live conditions, guarded by the resourceVersion read: a
    concurrent writer (the StatefulSet watcher) makes us re-read instead of overwriting it."""
    written = kube.update_status(
        "DecodeService", owner.namespace, owner.name,
        lambda live: build(list((live.get("status") or {}).get("conditions") or [])), attempts)
    return dict(written[1]) if written else {}  # {}: deleted meanwhile


def current_layout_fits(kube: Kube, body: Mapping[str, Any]) -> tuple[bool, str]:
    """Does the layout in the status still fit the nodes (with this service's own pods not counted)?
    A layout that still fits is kept: re-planning on every capacity wobble would roll pods for nothing."""
    owner = render.owner_from_body(body)
    status = body.get("status") or {}
    layout = status.get("layout")
    if not layout or not int(layout.get("dp") or 0):
        return False, "no layout placed yet"
    spec = specmod.normalized(body["spec"])
    inv = build_inventory(kube, owner)
    return planner.layout_fits(layout, inv, specmod.request(spec))
