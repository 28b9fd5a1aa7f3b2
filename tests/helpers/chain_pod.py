"""What the kubelet does with a pod template, for running a rendered container as a local process.

Pure functions. Everything a container gets from its pod spec is taken as written (command, args,
env, the files of mounted ConfigMaps) except what cannot exist on a test machine, and that is
substituted in one documented way each:

* mount paths of ConfigMap, hostPath and PVC volumes (``/etc/switchyard``, ``/models/NAME``) →
  folders under a temporary directory: every string that starts with a mount path is rewritten to
  the folder (in argv, env, and the mounted ConfigMap files, so a file that names another mount
  still finds it); emptyDir mounts (``/tmp``, ``/dev/shm``) are scratch space that every machine
  has, and stay as they are;
* the pod's own network namespace → a free localhost port: a container port is rewritten to a host
  port wherever it appears as the value of ``--port`` or ``--http-port`` (what kube-proxy's Service →
  pod hop does);
* ``fieldRef`` env → the values the kubelet would put there for the pod ``POD_NAME``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

PORT_FLAGS = ("--port", "--http-port")
_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")


def expand(value: str, defined: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: earlier variables of the container; ``$$`` is a literal ``$``;
    an undefined reference stays as written."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return defined.get(m.group(1), m.group(0))

    return _REF.sub(sub, value)


def field_ref(path: str, pod: Mapping[str, Any]) -> str:
    meta = pod["metadata"]
    if path in ("metadata.name", "metadata.namespace"):
        return meta[path.split(".")[1]]
    m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if m:
        return meta.get("labels", {}).get(m.group(1), "")
    raise KeyError(f"fieldRef {path} is not emulated")


def container_env(container: Mapping[str, Any], pod: Mapping[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = field_ref(item["valueFrom"]["fieldRef"]["fieldPath"], pod)
        else:
            raise KeyError(f"env {item['name']}: only value and fieldRef are emulated")
    return env


def pod_of(statefulset: Mapping[str, Any], ordinal: int = 0) -> dict[str, Any]:
    """The pod the StatefulSet controller would create first."""
    name = statefulset["metadata"]["name"]
    labels = {**statefulset["spec"]["template"]["metadata"].get("labels", {}),
              "apps.kubernetes.io/pod-index": str(ordinal),
              "statefulset.kubernetes.io/pod-name": f"{name}-{ordinal}"}
    return {"metadata": {"name": f"{name}-{ordinal}", "namespace": statefulset["metadata"]["namespace"],
                         "labels": labels},
            "spec": statefulset["spec"]["template"]["spec"]}


class Localizer:
    """Mount path → local folder, container port → host port."""

    def __init__(self, mounts: Mapping[str, Path], ports: Mapping[int, int]) -> None:
        # Longest mount first, so /models/tiny wins over a hypothetical /models.
        self.mounts = dict(sorted(mounts.items(), key=lambda kv: -len(kv[0])))
        self.ports = dict(ports)

    def path(self, value: str) -> str:
        for mount, local in self.mounts.items():
            if value == mount or value.startswith(mount.rstrip("/") + "/"):
                return str(local) + value[len(mount.rstrip("/")):]
        return value

    def text(self, value: str) -> str:
        """Mount paths anywhere inside a file's text (a JSON layout naming the model folder), in one
        pass so that a rewritten path is never rewritten again."""
        if not self.mounts:
            return value
        pattern = "|".join(re.escape(m.rstrip("/")) for m in self.mounts)
        by_mount = {m.rstrip("/"): str(local) for m, local in self.mounts.items()}
        return re.sub(f"({pattern})(?=[/\"'\\s]|$)", lambda m: by_mount[m.group(1)], value)

    def argv(self, argv: Sequence[str]) -> list[str]:
        out: list[str] = []
        for i, arg in enumerate(argv):
            if i > 0 and argv[i - 1] in PORT_FLAGS and int(arg) in self.ports:
                out.append(str(self.ports[int(arg)]))
            else:
                out.append(self.path(arg))
        return out


def volume_sources(pod_spec: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod_spec.get("volumes", [])}
