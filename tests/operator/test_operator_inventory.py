"""Node inventory from GPU Feature Discovery labels, allocatable GPUs, pods, taints and readiness."""

from __future__ import annotations

from helpers.kube.harness import gpu_node
from switchyard.operator import inventory


def pod(node: str, gpus: int, name: str = "p", namespace: str = "other", labels: dict | None = None,
        phase: str = "Running", init_gpus: int = 0) -> dict:
    spec = {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}
    if init_gpus:
        spec["initContainers"] = [{"name": "i", "resources": {"requests": {"nvidia.com/gpu": init_gpus}}}]
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels or {}}, "spec": spec,
            "status": {"phase": phase}}


def test_hgx_node_is_its_own_nvswitch_domain():
    inv = inventory.build([gpu_node("h200-a"), gpu_node("h100-a", "NVIDIA-H100-80GB-HBM3", mem_mib=81559)])
    h100, h200 = inv.nodes  # sorted by name
    assert (h200.product, h200.gpus, h200.free, h200.nvswitch) == ("NVIDIA-H200", 8, 8, True)
    assert h200.domain == "node/h200-a"
    assert h200.memory_bytes == 143771 * 2**20
    assert h100.nvswitch and h100.memory_bytes == 81559 * 2**20


def test_pcie_and_unknown_products_are_not_nvswitch():
    inv = inventory.build([gpu_node("pcie", "NVIDIA-H100-PCIe"), gpu_node("nvl", "NVIDIA-H100-NVL"),
                           gpu_node("t4", "Tesla-T4", gpus=4, mem_mib=15360), gpu_node("two", "NVIDIA-H200", gpus=2)])
    assert [n.nvswitch for n in inv.nodes] == [False, False, False, False]


def test_label_override_and_clique():
    node = gpu_node("x", "Some-Future-GPU")
    node["metadata"]["labels"].update({"switchyard.dev/nvswitch": "true", "nvidia.com/gpu.clique": "domain-1.0"})
    (n,) = inventory.build([node]).nodes
    assert n.nvswitch and n.domain == "domain-1.0"


def test_free_gpus_subtract_other_pods_but_not_our_own():
    pods = [pod("h200-a", 2, "a"), pod("h200-a", 1, "b", init_gpus=3),  # init container dominates: 3
            pod("h200-a", 4, "done", phase="Succeeded"), pod("elsewhere", 8, "c"),
            pod("h200-a", 2, "ours", namespace="default", labels={"switchyard.dev/service": "llama"}),
            pod("h200-a", 1, "same-name-other-ns", namespace="team-b", labels={"switchyard.dev/service": "llama"})]
    (n,) = inventory.build([gpu_node("h200-a")], pods, ignore_pod_labels={"switchyard.dev/service": "llama"},
                           ignore_namespace="default").nodes
    assert n.free == 8 - 2 - 3 - 1


def test_cpu_nodes_are_skipped_and_quantities_parse():
    cpu = {"metadata": {"name": "cpu"}, "status": {"allocatable": {"cpu": "4"}, "conditions": []}}
    assert inventory.build([cpu]).nodes == ()
    assert [inventory.parse_quantity(q) for q in ("8", 8, "8000m", None, "x")] == [8, 8, 8, 0, 0]


def test_eligibility_reasons():
    nodes = [gpu_node("ok"), gpu_node("down", ready=False), gpu_node("tainted", taints=[
        {"key": "dedicated", "value": "training", "effect": "NoSchedule"}]), gpu_node("soft", taints=[
            {"key": "x", "effect": "PreferNoSchedule"}])]
    cordoned = gpu_node("cordoned")
    cordoned["spec"]["unschedulable"] = True
    nodes.append(cordoned)
    no_gfd = gpu_node("no-gfd")
    del no_gfd["metadata"]["labels"]["nvidia.com/gpu.memory"]
    nodes.append(no_gfd)
    inv = inventory.build(nodes)
    chosen, left_out = inv.eligible()
    assert sorted(n.name for n in chosen) == ["ok", "soft"]
    text = " | ".join(left_out)
    assert "down: not Ready" in text and "cordoned: cordoned" in text
    assert "tainted: taint dedicated=training:NoSchedule not tolerated" in text
    assert "no-gfd: no nvidia.com/gpu.memory label" in text
    chosen, _ = inv.eligible(tolerations=[{"key": "dedicated", "operator": "Equal", "value": "training",
                                           "effect": "NoSchedule"}])
    assert "tainted" in [n.name for n in chosen]
    chosen, left_out = inv.eligible(node_selector={"nvidia.com/gpu.product": "NVIDIA-H100"})
    assert chosen == []
    assert "ok: nodeSelector nvidia.com/gpu.product=NVIDIA-H100 does not match" in left_out
