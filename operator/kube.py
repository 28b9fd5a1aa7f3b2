"""The operator's thin Kubernetes I/O edge: get, list, create, replace, delete, status patches, and an
idempotent ``apply``. Blocking calls through the official client (auth, TLS and kubeconfig handling
come from it); the async handlers run them in a thread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import quote, urlencode

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

APPLIED_ANNOTATION = "switchyard.dev/applied-hash"
# Read-build-write rounds of one status before a conflict (HTTP 409) is left to the caller.
CONFLICT_ATTEMPTS = 5
USER_AGENT = "switchyard-operator"
# Kinds the operator renders or reads: kind -> (apiVersion, plural, namespaced).
RESOURCES: dict[str, tuple[str, str, bool]] = {
    "ConfigMap": ("v1", "configmaps", True),
    "Service": ("v1", "services", True),
    "Pod": ("v1", "pods", True),
    "Node": ("v1", "nodes", False),
    "StatefulSet": ("apps/v1", "statefulsets", True),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets", True),
    "DecodeService": ("switchyard.dev/v1alpha1", "decodeservices", True),
    "ClusterKopfPeering": ("kopf.dev/v1", "clusterkopfpeerings", False),
}


# Statuses with which the API server refuses an object as written (invalid, malformed): sending it
# again changes nothing.
REFUSED = (400, 422)


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message

    @property
    def refused(self) -> bool:
        """The API server refused the object itself (400 BadRequest, 422 Invalid)."""
        return self.status in REFUSED


def path(kind: str, namespace: str | None = None, name: str | None = None, subresource: str = "") -> str:
    api_version, plural, namespaced = RESOURCES[kind]
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced and namespace:
        base += f"/namespaces/{quote(namespace)}"
    base += f"/{plural}"
    if name:
        base += f"/{quote(name)}"
    if subresource:
        base += f"/{subresource}"
    return base


def desired_hash(obj: Mapping[str, Any]) -> str:
    """Digest of what we want an object to be, kept in an annotation: equal digest, nothing to do."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


@dataclasses.dataclass
class Kube:
    api: k8s_client.ApiClient

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account if there is one, else the kubeconfig (KUBECONFIG, ~/.kube/config)."""
        configuration = k8s_client.Configuration()
        try:
            k8s_config.load_incluster_config(client_configuration=configuration)
        except k8s_config.ConfigException:
            # Read KUBECONFIG now: the client's default location was fixed when it was imported.
            k8s_config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                        client_configuration=configuration)
        api = k8s_client.ApiClient(configuration)
        api.user_agent = USER_AGENT
        return cls(api)

    def connection(self) -> dict[str, Any]:
        """Where and how to connect, for kopf's login (same server, credentials and TLS as ours)."""
        cfg = self.api.configuration
        if getattr(cfg, "refresh_api_key_hook", None):
            cfg.refresh_api_key_hook(cfg)  # in-cluster tokens rotate
        token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken") or ""
        token = token.removeprefix("Bearer ").strip()
        return {"server": cfg.host, "ca_path": cfg.ssl_ca_cert, "insecure": not cfg.verify_ssl,
                "certificate_path": cfg.cert_file, "private_key_path": cfg.key_file,
                "scheme": "Bearer" if token else None, "token": token or None}

    # ---- raw --------------------------------------------------------------------------------------
    def request(self, method: str, url: str, body: Any = None, content_type: str = "application/json",
                query: Mapping[str, str] | None = None) -> Any:
        if query:
            url += "?" + urlencode(query)
        headers = {"Accept": "application/json", "Content-Type": content_type}
        method_, full_url, headers_, body_, _ = self.api.param_serialize(
            method=method, resource_path=url, header_params=headers, body=body, auth_settings=["BearerToken"])
        response = self.api.call_api(method_, full_url, header_params=headers_, body=body_,
                                     _request_timeout=30)
        response.read()
        data = json.loads(response.data) if response.data else None
        if response.status >= 400:
            message = data.get("message", "") if isinstance(data, dict) else str(response.data)[:200]
            raise ApiError(response.status, message)
        return data

    # ---- typed helpers ----------------------------------------------------------------------------
    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path(kind, namespace, name))
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str | None = None, label_selector: str = "") -> list[dict[str, Any]]:
        query = {"labelSelector": label_selector} if label_selector else None
        return list(self.request("GET", path(kind, namespace), query=query).get("items", []))

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path(obj["kind"], obj["metadata"].get("namespace")), body=obj)

    def replace(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("PUT", path(obj["kind"], meta.get("namespace"), meta["name"]), body=obj)

    def delete(self, kind: str, namespace: str | None, name: str) -> bool:
        try:
            self.request("DELETE", path(kind, namespace, name),
                         body={"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"})
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            raise

    def patch_status(self, kind: str, namespace: str | None, name: str, status: Mapping[str, Any],
                     resource_version: str | None = None) -> dict[str, Any]:
        """Merge-patch the status subresource; with ``resource_version`` only if nobody wrote since
        (409 otherwise), so that lists like conditions are never replaced from a stale read."""
        body: dict[str, Any] = {"status": status}
        if resource_version is not None:
            body["metadata"] = {"resourceVersion": resource_version}
        return self.request("PATCH", path(kind, namespace, name, "status"), body=body,
                            content_type="application/merge-patch+json")

    def update_status(self, kind: str, namespace: str | None, name: str,
                      build: Callable[[dict[str, Any]], Mapping[str, Any] | None],
                      attempts: int = CONFLICT_ATTEMPTS) -> tuple[dict[str, Any], Mapping[str, Any]] | None:
        """Read the object, ``build`` its status from what was read, and write it guarded by that read's
        resourceVersion: a concurrent writer (409) makes it read and build again rather than overwrite,
        up to ``attempts`` rounds (the last 409 is raised). Returns the object read and the status
        written; None, writing nothing, when the object is gone or ``build`` returns None."""
        for attempt in range(attempts):
            live = self.get(kind, namespace, name)
            if live is None:
                return None
            status = build(live)
            if status is None:
                return None
            try:
                self.patch_status(kind, namespace, name, status, resource_version=live["metadata"]["resourceVersion"])
                return live, status
            except ApiError as err:
                if err.status != 409 or attempt == attempts - 1:
                    raise
        return None

    def apply(self, obj: Mapping[str, Any]) -> str:
        """Create or replace ``obj`` so that it matches; "created", "updated" or "unchanged".

        Idempotent by construction (fixed names, a digest of the desired object in an annotation), so
        a restarted operator converges without duplicates. Replacing sends the live resourceVersion:
        a concurrent writer makes it fail with 409 and the next reconcile retries.
        """
        desired = json.loads(json.dumps(obj))
        digest = desired_hash(desired)
        desired["metadata"].setdefault("annotations", {})[APPLIED_ANNOTATION] = digest
        meta = desired["metadata"]
        live = self.get(desired["kind"], meta.get("namespace"), meta["name"])
        if live is None:
            try:
                self.create(desired)
                return "created"
            except ApiError as err:
                if err.status != 409:
                    raise
                live = self.get(desired["kind"], meta.get("namespace"), meta["name"])
                if live is None:
                    raise
        if (live.get("metadata", {}).get("annotations") or {}).get(APPLIED_ANNOTATION) == digest:
            return "unchanged"
        meta["resourceVersion"] = live["metadata"]["resourceVersion"]
        if desired["kind"] == "Service":
            # Cluster IPs are allocated by the API server and immutable; carry them over.
            for key in ("clusterIP", "clusterIPs"):
                if key in live.get("spec", {}) and key not in desired["spec"]:
                    desired["spec"][key] = live["spec"][key]
        try:
            self.replace(desired)
        except ApiError as err:
            if err.status != 422 or desired["kind"] != "StatefulSet" or "Forbidden" not in err.message:
                raise
            # An immutable StatefulSet field changed ("spec: Forbidden: updates to statefulset spec for
            # fields other than ..."): the only way forward is a new object.
            self.delete(desired["kind"], meta.get("namespace"), meta["name"])
            del meta["resourceVersion"]
            self.create(desired)
            return "recreated"
        return "updated"
