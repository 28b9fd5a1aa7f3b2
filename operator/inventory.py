"""GPU node inventory from Kubernetes Node and Pod objects (plain dicts). Pure.

What a node offers comes from GPU Feature Discovery labels (``nvidia.com/gpu.product``,
``nvidia.com/gpu.count``, ``nvidia.com/gpu.memory`` in MiB) and from ``status.allocatable
["nvidia.com/gpu"]`` less what running pods already request. The NVSwitch domain: on HGX boards (SXM,
4 or 8 GPUs) every GPU reaches every other through NVSwitch, so the node is the domain; GFD publishes
``nvidia.com/gpu.clique`` only on multi-node NVLink systems, and we record it but still keep tensor
parallelism inside one pod. Anything we cannot identify as SXM is treated as PCIe: no custom
all-reduce, strategy ``xla``. Admins can override with the node label ``switchyard.dev/nvswitch``.

Label and allocatable values are parsed strictly (decimal integers in a sane range): a node with any
other value (``inf``, ``nan``, ``1e308``, ``-8``, ``lots``) is skipped and named in
``Inventory.skipped``, so that one mislabelled node never stops the planning of anything else.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
MEMORY_LABEL = "nvidia.com/gpu.memory"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
NVSWITCH_LABEL = "switchyard.dev/nvswitch"
HOSTNAME_LABEL = "kubernetes.io/hostname"
# Largest values a node may claim: beyond these a label is a typo or an attack, not hardware.
MAX_GPUS_PER_NODE = 1024
MAX_GPU_MEMORY_MIB = 1 << 24  # 16 TiB per GPU
# The taint the NVIDIA GPU operator and most clouds put on GPU nodes; our pods always tolerate it.
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}

# SXM parts that ship on HGX boards; PCIe and NVL (PCIe with NVLink bridges) parts do not have NVSwitch.
_SXM_FAMILIES = re.compile(r"(A100-SXM|H100|H200|H20|H800|B100|B200|GB200|B300)", re.IGNORECASE)
_NOT_SXM = re.compile(r"(PCIE|NVL$|NVL-)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class GpuNode:
    name: str
    hostname: str
    product: str
    gpus: int  # GPUs on the node (allocatable)
    free: int  # allocatable less what running pods (other than ours) request
    memory_bytes: int  # per GPU
    nvswitch: bool
    domain: str  # NVSwitch domain id: the clique where GFD gives one, else the node
    ready: bool
    schedulable: bool
    taints: tuple[Mapping[str, str], ...] = ()
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.ready and self.schedulable and self.gpus > 0


@dataclasses.dataclass(frozen=True)
class SkippedNode:
    """A GPU node left out of the inventory because one of its values cannot be read."""

    name: str
    field: str  # the label (or ``status.allocatable[nvidia.com/gpu]``) that is wrong
    value: str  # as found, cut short
    why: str

    @property
    def message(self) -> str:
        return f"node {self.name} skipped: {self.field}={self.value!r} {self.why}"


@dataclasses.dataclass(frozen=True)
class Inventory:
    nodes: tuple[GpuNode, ...]
    skipped: tuple[SkippedNode, ...] = ()

    def eligible(self, node_selector: Mapping[str, str] | None = None,
                 tolerations: Sequence[Mapping[str, Any]] = ()) -> tuple[list[GpuNode], list[str]]:
        """Nodes a DecodeService's pods may run on, and why the others were left out."""
        chosen: list[GpuNode] = []
        left_out: list[str] = []
        all_tolerations = [*tolerations, GPU_TOLERATION]
        for node in self.nodes:
            why = _why_not(node, node_selector or {}, all_tolerations)
            if why:
                left_out.append(f"{node.name}: {why}")
            else:
                chosen.append(node)
        return chosen, left_out


class BadValue(ValueError):
    """A label or quantity that is not a whole number in its sane range (the message says why)."""


_WHOLE = re.compile(r"[0-9]{1,19}")
_MILLI = re.compile(r"([0-9]{1,22})m")


def strict_int(value: Any, maximum: int) -> int:
    """A decimal integer in ``[0, maximum]``, as GFD writes its labels ("8", "143771"); anything else
    (floats, exponents, ``inf``/``nan``, signs, words, out of range) raises :class:`BadValue`."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise BadValue("is not a whole number")
    text = str(value).strip()
    if not _WHOLE.fullmatch(text):
        raise BadValue("is not a whole number")
    number = int(text)
    if number > maximum:
        raise BadValue(f"is above {maximum}")
    return number


def strict_quantity(value: Any, maximum: int) -> int:
    """An integer extended-resource quantity ("8", 8, "8000m") in ``[0, maximum]``; else :class:`BadValue`."""
    if isinstance(value, str) and (m := _MILLI.fullmatch(value.strip())):
        return strict_int(str(int(m.group(1)) // 1000), maximum)
    return strict_int(value, maximum)


def parse_quantity(value: Any) -> int:
    """Integer quantities as Kubernetes writes them for extended resources ("8", 8, "8000m"); 0 for
    what is absent or unreadable (the API server validates pods' quantities; this never raises)."""
    if value is None:
        return 0
    try:
        return strict_quantity(value, MAX_GPUS_PER_NODE)
    except BadValue:
        return 0


def pod_gpus(pod: Mapping[str, Any]) -> int:
    """GPUs a pod holds: the larger of the sum over app containers and any init container (the
    scheduler's rule); for extended resources a limit implies the same request."""
    spec = pod.get("spec", {})

    def wanted(container: Mapping[str, Any]) -> int:
        res = container.get("resources", {}) or {}
        req = (res.get("requests") or {}).get(GPU_RESOURCE)
        lim = (res.get("limits") or {}).get(GPU_RESOURCE)
        return parse_quantity(req if req is not None else lim)

    app = sum(wanted(c) for c in spec.get("containers", []) or [])
    init = max((wanted(c) for c in spec.get("initContainers", []) or []), default=0)
    return max(app, init)


def is_nvswitch(product: str, count: int, labels: Mapping[str, str]) -> bool:
    override = labels.get(NVSWITCH_LABEL)
    if override is not None:
        return override.lower() == "true"
    return count in (4, 8) and bool(_SXM_FAMILIES.search(product)) and not _NOT_SXM.search(product)


def build(nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]] = (),
          ignore_pod_labels: Mapping[str, str] | None = None, ignore_namespace: str | None = None) -> Inventory:
    """Inventory of the GPU nodes. Pods in ``ignore_namespace`` whose labels include
    ``ignore_pod_labels`` do not count as using GPUs (the DecodeService's own pods, so that a re-plan
    may reuse what it already holds)."""
    used: dict[str, int] = {}
    for pod in pods:
        meta = pod.get("metadata", {})
        node_name = pod.get("spec", {}).get("nodeName")
        if not node_name or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        labels = meta.get("labels") or {}
        if (ignore_pod_labels and meta.get("namespace") == ignore_namespace
                and all(labels.get(k) == v for k, v in ignore_pod_labels.items())):
            continue
        used[node_name] = used.get(node_name, 0) + pod_gpus(pod)

    out = []
    skipped = []
    for node in nodes:
        meta = node.get("metadata", {})
        labels: Mapping[str, str] = meta.get("labels") or {}
        status = node.get("status", {})
        name = meta["name"]
        allocatable_field = f"status.allocatable[{GPU_RESOURCE}]"
        raw = {allocatable_field: (status.get("allocatable") or {}).get(GPU_RESOURCE),
               COUNT_LABEL: labels.get(COUNT_LABEL), MEMORY_LABEL: labels.get(MEMORY_LABEL)}
        parsers = {allocatable_field: lambda v: strict_quantity(v, MAX_GPUS_PER_NODE),
                   COUNT_LABEL: lambda v: strict_int(v, MAX_GPUS_PER_NODE),
                   MEMORY_LABEL: lambda v: strict_int(v, MAX_GPU_MEMORY_MIB)}
        values: dict[str, int] = {}
        bad: SkippedNode | None = None
        for field, value in raw.items():
            try:
                values[field] = 0 if value is None else parsers[field](value)
            except BadValue as err:
                bad = bad or SkippedNode(name, field, str(value)[:64], str(err))
        allocatable = values.get(allocatable_field, 0)
        if allocatable <= 0 and GPU_RESOURCE not in (status.get("capacity") or {}) and (
                bad is None or bad.field != allocatable_field):
            continue  # not a GPU node
        if bad is not None:
            skipped.append(bad)
            continue
        product = labels.get(PRODUCT_LABEL, "unknown")
        count = values[COUNT_LABEL] or allocatable
        memory_mib = values[MEMORY_LABEL]
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in status.get("conditions", []) or [])
        nvswitch = is_nvswitch(product, count, labels)
        out.append(GpuNode(
            name=name,
            hostname=labels.get(HOSTNAME_LABEL, name),
            product=product,
            gpus=allocatable,
            free=max(allocatable - used.get(name, 0), 0),
            memory_bytes=memory_mib * 1024 * 1024,
            nvswitch=nvswitch,
            domain=labels.get(CLIQUE_LABEL) or f"node/{name}",
            ready=ready,
            schedulable=not node.get("spec", {}).get("unschedulable", False),
            taints=tuple(node.get("spec", {}).get("taints", []) or []),
            labels=dict(labels),
        ))
    out.sort(key=lambda n: n.name)
    return Inventory(tuple(out), tuple(sorted(skipped, key=lambda n: n.name)))


def _why_not(node: GpuNode, selector: Mapping[str, str], tolerations: Sequence[Mapping[str, Any]]) -> str:
    if not node.ready:
        return "not Ready"
    if not node.schedulable:
        return "cordoned"
    if node.gpus <= 0:
        return "no allocatable GPUs"
    if node.memory_bytes <= 0:
        return f"no {MEMORY_LABEL} label (GPU Feature Discovery not running?)"
    for key, value in selector.items():
        if node.labels.get(key) != value:
            return f"nodeSelector {key}={value} does not match"
    for taint in node.taints:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, taint):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} not tolerated"
    return ""


def _tolerates(tolerations: Sequence[Mapping[str, Any]], taint: Mapping[str, str]) -> bool:
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        op = tol.get("operator", "Equal")
        if not tol.get("key") and op == "Exists":
            return True
        if tol.get("key") != taint.get("key"):
            continue
        if op == "Exists" or tol.get("value", "") == taint.get("value", ""):
            return True
    return False
