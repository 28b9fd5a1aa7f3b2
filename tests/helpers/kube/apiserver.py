"""An in-process Kubernetes API server for the operator tests: kmock's KubernetesEmulator, plus the
behaviour of a real API server that kopf, the operator and kubectl rely on and plain kmock 0.8 lacks.

kmock provides the HTTP server, request parsing, the discovery endpoints, its catalogue of built-in
resources (a k3s cluster's) and the object store (``server.objects[...]`` works for assertions). This
subclass adds, and fakes nothing beyond:

* metadata on create: ``uid``, ``resourceVersion`` (one cluster-wide counter), ``creationTimestamp``,
  ``generation`` (bumped when anything outside metadata/status changes), ``generateName``; create
  answers 201; names must be new (409 AlreadyExists) and the namespace must exist (404);
* optimistic concurrency: a PUT or PATCH carrying a stale ``metadata.resourceVersion`` gets 409;
* PUT (replace), JSON merge patch (RFC 7386), JSON patch; strategic merge patch is treated as a JSON
  merge patch (lists replaced whole: no patch-merge keys), server-side apply answers 415;
* subresources: ``/status`` writes change only ``.status`` and writes to the main resource leave
  ``.status`` alone when the resource has a status subresource; ``/scale`` reads and writes
  ``spec.replicas`` (CRD ``specReplicasPath``) as an ``autoscaling/v1`` Scale;
* CRDs: creating one serves its resource at once (discovery, status/scale subresources), marks it
  Established, and admits its objects against the openAPIV3Schema: defaults applied, unknown fields
  pruned or, with ``fieldValidation=Strict``, rejected (422 Invalid with the field paths), and the
  CEL rules (``x-kubernetes-validations``) of its schema evaluated;
* admission policies (``ApiServer.policies``, as a ValidatingAdmissionPolicy): a test's check on
  the objects of one resource, whose complaints refuse a create or update with 422 Invalid;
* finalizers and ``deletionTimestamp``; deletion of an owner removes its dependents in the background,
  as kube-controller-manager's garbage collector does;
* lists with ``kind: <Kind>List``, ``apiVersion`` and the current ``resourceVersion``; label and field
  (``metadata.name``/``metadata.namespace``) selectors;
* watches: from ``resourceVersion=N`` every later event is replayed from an event log, so a client
  that resumes misses nothing; without one the current objects come as ADDED first; ``timeoutSeconds``
  ends the stream; ``/api/v1`` discovery of the core resources; server version 1.31;
* server-side printing: ``kubectl get`` of a custom resource gets a Table of its
  additionalPrinterColumns (dates as ages), as from a real API server.

Not emulated: controllers (no Pods appear for a StatefulSet; tests write StatefulSet status as the
StatefulSet controller would), admission webhooks, RBAC, OpenAPI endpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import datetime
import gzip
import importlib.resources
import json
import re
import secrets
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp.web
import jsonpatch
import kmock
from kmock._internal import apps, rendering
from kmock._internal.references import ResourceInfo, resource

from helpers.kube import crschema

NOT_FOUND_REASON = "NotFound"


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> aiohttp.web.Response:
    return aiohttp.web.json_response({
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "details": details or {}, "code": code,
    }, status=code)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur:
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_match(selector: str, labels: dict[str, str]) -> bool:
    for term in _split_selector(selector):
        if m := re.fullmatch(r"([^\s!=]+)\s+(in|notin)\s+\((.*)\)", term):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if (labels.get(key) in values) != (op == "in") or (op == "in" and key not in labels):
                return False
        elif "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def field_match(selector: str, obj: dict[str, Any]) -> bool:
    meta = obj.get("metadata", {})
    fields = {"metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace")}
    for term in _split_selector(selector):
        negate = "!=" in term
        key, value = re.split(r"!=|==|=", term, maxsplit=1)
        if key.strip() not in fields:
            raise ValueError(f'field label not supported: {key.strip()}')
        if (fields[key.strip()] == value.strip()) == negate:
            return False
    return True


@dataclasses.dataclass
class Gate:
    """Holds the first matching request until released, then lets it through or fails it with 503
    (a test's way to stop an operator in the middle of a reconcile)."""

    method: str
    plural: str
    fail: bool = False
    reached: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    release: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    used: bool = False


class ApiServer(kmock.KubernetesEmulator):
    """See the module docstring. Use through :func:`running`."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        # kmock's catalogue of built-in resources (its load_bundled() uses a deprecated importlib call).
        bundled = importlib.resources.files("kmock._internal").joinpath("resources.json.gz").read_bytes()
        self.resources.load_data(gzip.decompress(bundled))
        self.rv = 0
        self.log: list[tuple[int, resource, str, dict[str, Any]]] = []
        self.changed = asyncio.Condition()
        self.crd_schemas: dict[resource, dict[str, Any]] = {}
        self.crd_scale: dict[resource, dict[str, str]] = {}
        self.crd_columns: dict[resource, list[dict[str, Any]]] = {}
        self.gc_tasks: set[asyncio.Task[None]] = set()
        self.gates: list[Gate] = []
        # (plural, check): check(object) -> complaints ("field: what is wrong"); any refuses the write.
        self.policies: list[tuple[str, Callable[[dict[str, Any]], list[str]]]] = []
        self.closing = False  # set at shutdown: open watches end
        self.writes: list[tuple[str, str, str | None, str]] = []  # (method, plural, name, agent) of writes
        # (user agent, RBAC verb, API group, resource[/subresource]) of every resource request
        self.verbs: set[tuple[str, str, str, str]] = set()
        for ns in ("default", "kube-system"):
            self.seed({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})

    async def _serve_server_version(self, request: rendering.Request) -> rendering.Payload:
        return {"major": "1", "minor": "31", "gitVersion": "v1.31.0", "platform": "linux/amd64"}

    async def _serve_version(self, request: rendering.Request) -> rendering.Payload:
        # kmock lists subresources with the parent's short names; a real server gives them none.
        payload = await super()._serve_version(request)
        for entry in payload["resources"]:
            if "/" in entry["name"]:
                entry["shortNames"], entry["categories"] = [], []
        return payload

    # ---- helpers --------------------------------------------------------------------------------
    def info(self, res: resource) -> ResourceInfo | None:
        for known in self.resources:
            if (known.group, known.version, known.plural) == (res.group, res.version, res.plural):
                return self.resources[known]
        return None

    def _res(self, api_version: str, plural: str) -> resource:
        group, _, version = api_version.rpartition("/")
        return resource(group, version, plural)

    def plural_of(self, api_version: str, kind: str) -> resource:
        group, _, version = api_version.rpartition("/")
        for known in self.resources:
            if (known.group, known.version) == (group, version) and self.resources[known].kind == kind:
                return known
        raise KeyError(f"no resource of kind {kind} in {api_version}")

    def stored(self, res: resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = (res, namespace, name)
        if key in self.objects and not self.objects[key].deleted:
            return copy.deepcopy(self.objects[key].raw)
        return None

    def all(self, res: resource, namespace: str | None = None) -> list[dict[str, Any]]:
        out = []
        for (r, ns, _name), obj in self.objects.items():
            same = (r.group, r.version, r.plural) == (res.group, res.version, res.plural)
            if same and not obj.deleted and (namespace is None or ns == namespace):
                out.append(copy.deepcopy(obj.raw))
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _next_rv(self) -> str:
        self.rv += 1
        return str(self.rv)

    async def _record(self, res: resource, etype: str, obj: dict[str, Any]) -> None:
        self.log.append((self.rv, res, etype, copy.deepcopy(obj)))
        async with self.changed:
            self.changed.notify_all()

    def seed(self, obj: dict[str, Any]) -> None:
        """Store an object synchronously (fixture set-up, before anyone watches)."""
        res = self.plural_of(obj["apiVersion"], obj["kind"])
        obj = copy.deepcopy(obj)
        meta = obj["metadata"]
        meta.update(uid=str(uuid.uuid4()), resourceVersion=self._next_rv(), creationTimestamp=_now(), generation=1)
        self.objects[res, meta.get("namespace"), meta["name"]] = obj
        self.log.append((self.rv, res, "ADDED", copy.deepcopy(obj)))

    # ---- dispatch -------------------------------------------------------------------------------
    async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        if res is None or res.plural is None:
            return await apps.RawHandler._handle(self, request)  # discovery and anything non-resource
        info = self.info(res)
        if info is None:
            return _status(404, NOT_FOUND_REASON, "the server could not find the requested resource")
        self.verbs.add((request.headers.get("User-Agent", ""), _verb(request), res.group or "",
                        res.plural + (f"/{request.subresource}" if request.subresource else "")))
        if request.method == "GET" and request.params.get("watch") in ("true", "1"):
            return await self._watch(request, res)  # long-lived: never holds the store's lock
        for gate in self.gates:
            if not gate.used and gate.method == request.method and gate.plural == res.plural:
                gate.used = True
                gate.reached.set()
                await gate.release.wait()
                if gate.fail:
                    return _status(503, "ServiceUnavailable", "the request was cut off")
        if request.method != "GET":
            name = request.name or ((request.data or {}).get("metadata") or {}).get("name")
            self.writes.append((request.method.value, res.plural, name, request.headers.get("User-Agent", "")))
        async with self._lock:
            return await self._serve(request, res, info)

    async def _serve(self, request: rendering.Request, res: resource, info: ResourceInfo) -> aiohttp.web.StreamResponse:
        method = request.method.value if hasattr(request.method, "value") else str(request.method)
        name, ns, sub = request.name, request.namespace, request.subresource
        if method == "GET" and name is None:
            return self._list(request, res, info)
        if method == "POST" and name is None:
            return await self._create(request, res, info)
        if name is None:
            return _status(405, "MethodNotAllowed", f"{method} on a collection is not supported here")
        current = self.stored(res, ns, name)
        if current is None:
            return _status(404, NOT_FOUND_REASON, f'{res.plural}.{res.group or "core"} "{name}" not found',
                           {"name": name, "kind": res.plural})
        if method == "GET":
            if sub == "scale":
                return aiohttp.web.json_response(self._scale(res, current))
            if self._wants_table(request, res):
                return aiohttp.web.json_response(self._table(res, [current]))
            return aiohttp.web.json_response(current)
        if method == "DELETE":
            return await self._delete(res, current)
        if method in ("PUT", "PATCH"):
            return await self._write(request, res, info, current, method, sub)
        return _status(405, "MethodNotAllowed", f"{method} is not supported")

    # ---- reads ----------------------------------------------------------------------------------
    def _matches(self, request: rendering.Request, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        if request.namespace is not None and meta.get("namespace") != request.namespace:
            return False
        if request.name is not None and meta.get("name") != request.name:
            return False
        if (sel := request.params.get("labelSelector")) and not label_match(sel, meta.get("labels") or {}):
            return False
        return not ((sel := request.params.get("fieldSelector")) and not field_match(sel, obj))

    def _list(self, request: rendering.Request, res: resource, info: ResourceInfo) -> aiohttp.web.Response:
        items = [o for o in self.all(res) if self._matches(request, o)]
        if self._wants_table(request, res):
            return aiohttp.web.json_response(self._table(res, items))
        api_version = f"{res.group}/{res.version}" if res.group else res.version
        return aiohttp.web.json_response({
            "apiVersion": api_version, "kind": f"{info.kind}List",
            "metadata": {"resourceVersion": str(self.rv)}, "items": items,
        })

    def _wants_table(self, request: rendering.Request, res: resource) -> bool:
        # kubectl get asks for server-side printing; for CRDs the server prints additionalPrinterColumns.
        return "as=Table" in request.headers.get("Accept", "") and res in self.crd_columns

    def _table(self, res: resource, objs: list[dict[str, Any]]) -> dict[str, Any]:
        columns = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
                    "description": "Name must be unique within a namespace."}]
        columns += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
                     "priority": c.get("priority", 0), "description": c.get("description", "")}
                    for c in self.crd_columns[res]]
        rows = []
        for obj in objs:
            cells: list[Any] = [obj["metadata"]["name"]]
            for c in self.crd_columns[res]:
                value = _get_path(obj, c["jsonPath"])
                if c["type"] == "date" and value:
                    value = _age(value)  # the API server prints dates as ages, as kubectl shows them
                cells.append(value)
            rows.append({"cells": cells, "object": {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                                                    "metadata": obj["metadata"]}})
        return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {"resourceVersion": str(self.rv)},
                "columnDefinitions": columns, "rows": rows}

    async def _watch(self, request: rendering.Request, res: resource) -> aiohttp.web.StreamResponse:
        raw = request._raw_request
        assert raw is not None
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw)
        timeout = float(request.params.get("timeoutSeconds") or 3600)
        deadline = time.monotonic() + timeout
        since = request.params.get("resourceVersion")

        def same(r: resource) -> bool:
            return (r.group, r.version, r.plural) == (res.group, res.version, res.plural)

        async def send(etype: str, obj: dict[str, Any]) -> None:
            await response.write(json.dumps({"type": etype, "object": obj}).encode() + b"\n")

        if not since or since == "0":
            position = len(self.log)
            for obj in self.all(res):
                if self._matches(request, obj):
                    await send("ADDED", obj)
        else:
            start = int(since)
            position = next((i for i, entry in enumerate(self.log) if entry[0] > start), len(self.log))
        try:
            while time.monotonic() < deadline and not self.closing:
                if raw.transport is None or raw.transport.is_closing():
                    break  # the client went away (a stopped operator never says goodbye)
                while position < len(self.log):
                    _rv, r, etype, obj = self.log[position]
                    position += 1
                    if same(r) and self._matches(request, obj):
                        await send(etype, obj)
                async with self.changed:
                    if position >= len(self.log):
                        with contextlib.suppress(TimeoutError):
                            wait = min(max(deadline - time.monotonic(), 0.01), 0.5)
                            await asyncio.wait_for(self.changed.wait(), wait)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        return response

    def _scale(self, res: resource, obj: dict[str, Any]) -> dict[str, Any]:
        paths = self.crd_scale.get(res, {"spec": ".spec.replicas", "status": ".status.replicas"})
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid", "resourceVersion",
                                                        "creationTimestamp") if k in obj["metadata"]},
            "spec": {"replicas": _get_path(obj, paths["spec"]) or 0},
            "status": {"replicas": _get_path(obj, paths["status"]) or 0,
                       **({"selector": s} if (s := _get_path(obj, paths.get("selector", ""))) else {})},
        }

    # ---- writes ---------------------------------------------------------------------------------
    def _admit(self, request: rendering.Request, res: resource,
               obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        schema = self.crd_schemas.get(res)
        if schema is None:
            return obj, self._policy_errors(res, obj)
        strict = request.params.get("fieldValidation") == "Strict"
        admitted, errors = crschema.admit(schema, obj, strict=strict)
        return admitted, errors or self._policy_errors(res, admitted)

    def _policy_errors(self, res: resource, obj: dict[str, Any]) -> list[str]:
        return [complaint for plural, check in self.policies if plural == res.plural for complaint in check(obj)]

    async def _create(self, request: rendering.Request, res: resource, info: ResourceInfo) -> aiohttp.web.Response:
        obj = request.data
        if not isinstance(obj, dict):
            return _status(400, "BadRequest", "the body must be a JSON object")
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        ns = request.namespace if info.namespaced else None
        if info.namespaced:
            if meta.get("namespace") not in (None, ns):
                return _status(400, "BadRequest", "the namespace of the provided object does not match "
                                                  "the namespace sent on the request")
            if self.stored(resource("", "v1", "namespaces"), None, ns or "") is None:
                return _status(404, NOT_FOUND_REASON, f'namespaces "{ns}" not found')
            meta["namespace"] = ns
        if not meta.get("name"):
            if not meta.get("generateName"):
                return _status(422, "Invalid", "metadata.name: Required value: name or generateName is required")
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if self.stored(res, ns, meta["name"]) is not None:
            return _status(409, "AlreadyExists", f'{res.plural} "{meta["name"]}" already exists',
                           {"name": meta["name"], "kind": res.plural})
        obj, errors = self._admit(request, res, obj)
        if errors:
            return _invalid(info, meta["name"], errors)
        meta = obj["metadata"]
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1, resourceVersion=self._next_rv())
        obj["apiVersion"] = f"{res.group}/{res.version}" if res.group else res.version
        obj["kind"] = info.kind
        if "status" in info.subresources and res.plural != "nodes":
            obj.pop("status", None)  # set through /status only (kubelets register Nodes with theirs)
        if res.plural == "customresourcedefinitions":
            self._serve_crd(obj)
        key = (res, ns, meta["name"])
        if key in self.objects:
            self.objects[key].create(obj)
        else:
            self.objects[key] = obj
        await self._record(res, "ADDED", obj)
        return aiohttp.web.json_response(obj, status=201)

    async def _write(self, request: rendering.Request, res: resource, info: ResourceInfo, current: dict[str, Any],
                     method: str, sub: str | None) -> aiohttp.web.Response:
        body = request.data
        ctype = (request.headers.get("Content-Type") or "application/json").split(";")[0].strip()
        if method == "PUT":
            incoming = copy.deepcopy(body)
        elif ctype in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            base = self._scale(res, current) if sub == "scale" else current
            incoming = merge_patch(base, body)
        elif ctype == "application/json-patch+json":
            base = self._scale(res, current) if sub == "scale" else current
            try:
                incoming = jsonpatch.apply_patch(base, body)
            except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as err:
                return _status(422, "Invalid", f"the JSON patch could not be applied: {err}")
        else:
            return _status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - "
                                                        f"accepted media types include: application/json-patch+json, "
                                                        f"application/merge-patch+json (got {ctype})")
        if not isinstance(incoming, dict):
            return _status(400, "BadRequest", "the body must be a JSON object")
        sent_rv = (body.get("metadata") or {}).get("resourceVersion") if isinstance(body, dict) else None
        if sent_rv is not None and str(sent_rv) != current["metadata"]["resourceVersion"]:
            name = current["metadata"]["name"]
            return _status(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": the object '
                                            "has been modified; please apply your changes to the latest version "
                                            "and try again", {"name": name})
        if sub == "status":
            new = copy.deepcopy(current)
            if "status" in incoming:
                new["status"] = incoming["status"]
            else:
                new.pop("status", None)
        elif sub == "scale":
            paths = self.crd_scale.get(res, {"spec": ".spec.replicas"})
            new = copy.deepcopy(current)
            _set_path(new, paths["spec"], int((incoming.get("spec") or {}).get("replicas", 0)))
        elif sub:
            return _status(404, NOT_FOUND_REASON, f"subresource {sub} is not served here")
        else:
            new = incoming
            new_meta = new.setdefault("metadata", {})
            for key in ("uid", "creationTimestamp", "generation", "deletionTimestamp", "namespace", "name"):
                if key in current["metadata"]:
                    new_meta[key] = current["metadata"][key]
            new["apiVersion"], new["kind"] = current["apiVersion"], current["kind"]
            if "status" in info.subresources:
                if "status" in current:
                    new["status"] = current["status"]
                else:
                    new.pop("status", None)
            new, errors = self._admit(request, res, new)
            if errors:
                return _invalid(info, current["metadata"]["name"], errors)
        def essence(o: dict[str, Any]) -> dict[str, Any]:
            return {k: v for k, v in o.items() if k not in ("metadata", "status")}
        if essence(new) != essence(current):
            new["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
        if new == current:
            return aiohttp.web.json_response(current)  # a no-op write changes nothing, not even the version
        new["metadata"]["resourceVersion"] = self._next_rv()
        key = (res, current["metadata"].get("namespace"), current["metadata"]["name"])
        if new["metadata"].get("deletionTimestamp") and not new["metadata"].get("finalizers"):
            self.objects[key].history.append(new)
            self.objects[key].delete()
            await self._record(res, "DELETED", new)
            self._collect_dependents(new)
        else:
            self.objects[key].history.append(new)
            await self._record(res, "MODIFIED", new)
        if sub == "scale":
            return aiohttp.web.json_response(self._scale(res, new))
        return aiohttp.web.json_response(new)

    async def _delete(self, res: resource, current: dict[str, Any]) -> aiohttp.web.Response:
        meta = current["metadata"]
        key = (res, meta.get("namespace"), meta["name"])
        if meta.get("finalizers"):
            if not meta.get("deletionTimestamp"):
                meta["deletionTimestamp"] = _now()
                meta["deletionGracePeriodSeconds"] = 0
                meta["resourceVersion"] = self._next_rv()
                self.objects[key].history.append(current)
                await self._record(res, "MODIFIED", current)
            return aiohttp.web.json_response(current, status=202)
        meta["resourceVersion"] = self._next_rv()
        self.objects[key].delete()
        await self._record(res, "DELETED", current)
        if res.plural == "customresourcedefinitions":
            self._unserve_crd(current)
        self._collect_dependents(current)
        return aiohttp.web.json_response(current)

    # ---- garbage collector (kube-controller-manager's job) ---------------------------------------
    def _collect_dependents(self, owner: dict[str, Any]) -> None:
        task = asyncio.get_running_loop().create_task(self._gc(owner["metadata"]["uid"]))
        self.gc_tasks.add(task)
        task.add_done_callback(self.gc_tasks.discard)

    async def _gc(self, uid: str) -> None:
        async with self._lock:
            doomed = [(key, obj.raw) for key, obj in list(self.objects.items()) if not obj.deleted
                      and any(ref.get("uid") == uid for ref in obj.raw["metadata"].get("ownerReferences", []))]
            for (res, _ns, _name), obj in doomed:
                await self._delete(res, copy.deepcopy(obj))

    # ---- CRDs -----------------------------------------------------------------------------------
    def _serve_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            res = resource(spec["group"], version["name"], names["plural"])
            subresources = set(version.get("subresources", {}))
            self.resources[res] = ResourceInfo(
                namespaced=spec["scope"] == "Namespaced", kind=names["kind"], singular=names.get("singular"),
                verbs={"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"},
                shortnames=set(names.get("shortNames", [])), categories=set(names.get("categories", [])),
                subresources=subresources)
            if "schema" in version:
                self.crd_schemas[res] = version["schema"]["openAPIV3Schema"]
            self.crd_columns[res] = version.get("additionalPrinterColumns", [])
            if "scale" in version.get("subresources", {}):
                scale = version["subresources"]["scale"]
                self.crd_scale[res] = {"spec": scale["specReplicasPath"], "status": scale["statusReplicasPath"],
                                       "selector": scale.get("labelSelectorPath", "")}
        crd["status"] = {
            "acceptedNames": names,
            "storedVersions": [v["name"] for v in spec["versions"] if v.get("storage")],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "lastTransitionTime": _now(), "message": m}
                for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                ("Established", "InitialNamesAccepted", "the initial names have been accepted"))],
        }

    def _unserve_crd(self, crd: dict[str, Any]) -> None:
        spec = crd["spec"]
        for version in spec["versions"]:
            res = resource(spec["group"], version["name"], spec["names"]["plural"])
            for known in list(self.resources):
                if (known.group, known.version, known.plural) == (res.group, res.version, res.plural):
                    del self.resources[known]
            self.crd_schemas.pop(res, None)

    async def close_watches(self) -> None:
        self.closing = True
        async with self.changed:
            self.changed.notify_all()

    def gate(self, method: str, plural: str, fail: bool = False) -> Gate:
        gate = Gate(method, plural, fail)
        self.gates.append(gate)
        return gate

    # ---- synchronous conveniences for tests --------------------------------------------------------
    async def apply_objects(self, objs: Iterable[dict[str, Any]]) -> None:
        """Create objects through the HTTP API (as a client would)."""
        for obj in objs:
            res = self.plural_of(obj["apiVersion"], obj["kind"])
            ns = obj["metadata"].get("namespace")
            base = f"/apis/{res.group}/{res.version}" if res.group else f"/api/{res.version}"
            url = f"{base}/namespaces/{ns}/{res.plural}" if ns else f"{base}/{res.plural}"
            async with self.post(url, json=obj) as response:
                if response.status >= 300:
                    raise AssertionError(f"creating {obj['kind']} {obj['metadata']['name']}: "
                                         f"{response.status} {await response.text()}")


def _verb(request: rendering.Request) -> str:
    """The RBAC verb of a request, as the API server's authorizer names it."""
    method = request.method.value
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "list" if request.name is None else "get"
    return {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method, method.lower())


def _invalid(info: ResourceInfo, name: str, errors: list[str]) -> aiohttp.web.Response:
    return _status(422, "Invalid", f'{info.kind} "{name}" is invalid: ' + "; ".join(errors),
                   {"name": name, "kind": info.kind,
                    "causes": [{"reason": "FieldValueInvalid", "message": e} for e in errors]})


def _age(timestamp: str) -> str:
    then = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    seconds = int((datetime.datetime.now(datetime.UTC) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def _get_path(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in [p for p in path.split(".") if p]:
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _set_path(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = [p for p in path.split(".") if p]
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value
