"""README.md's `kubectl get decodeservices` example is what the code prints: the planner and renderer
give the status of each example DecodeService on the example nodes, the CRD's printer columns pick
the fields, and kubectl's column layout prints them."""

from __future__ import annotations

import re
from typing import Any

import yaml
from helpers import ROOT
from switchyard.operator import crd, inventory, planner, render
from switchyard.operator import spec as specmod

EXAMPLES = ("llama-3-8b", "tiny")
NODES = ROOT / "tests" / "helpers" / "kube" / "nodes-hgx.yaml"
# The one column the code does not decide; the README shows a fresh object.
AGE = "1s"
# kubectl's tabwriter: cells padded by 3 spaces, at least 6 wide, the last column not padded.
PADDING, MIN_WIDTH = 3, 6


def status_of(name: str, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """The status the operator writes before any pod is ready (reconcile: plan_status plus ready)."""
    body = yaml.safe_load((ROOT / "manifests" / "examples" / f"{name}.yaml").read_text())
    body["metadata"]["uid"] = "uid"
    spec = specmod.normalized(body["spec"])
    plan = planner.plan(specmod.model_spec(spec), inventory.build(nodes), specmod.request(spec))
    status = render.plan_status(plan, render.owner_from_body(body))
    dp = plan.layout.dp if plan.layout else 0
    status.update({"readyReplicas": 0, "ready": f"0/{dp}"})
    return {**body, "status": status}


def cell(value: Any) -> str:
    """A Table cell as kubectl prints it (Go's %v: 3.0 is "3")."""
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return "" if value is None else str(value)


def field(obj: dict[str, Any], json_path: str) -> Any:
    for key in json_path.lstrip(".").split("."):
        obj = (obj or {}).get(key)
    return obj


def kubectl_get(objs: list[dict[str, Any]]) -> str:
    version = next(v for v in crd.load_crd()["spec"]["versions"] if v["name"] == crd.VERSION)
    columns = [c for c in version["additionalPrinterColumns"] if not c.get("priority")]
    rows = [["NAME", *(c["name"].upper() for c in columns)]]
    for obj in objs:
        rows.append([obj["metadata"]["name"], *(AGE if c["type"] == "date" else cell(field(obj, c["jsonPath"]))
                                                 for c in columns)])
    widths = [max(max(len(r[i]) for r in rows) + PADDING, MIN_WIDTH) for i in range(len(rows[0]))]
    return "\n".join("".join(c.ljust(w) for c, w in zip(r[:-1], widths[:-1], strict=True)) + r[-1]
                     for r in rows)


def readme_block() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"`tests/helpers/kube/nodes-hgx\.yaml`, before any pod is ready\):\n\n```\n(.*?)\n```",
                      text, re.S)
    assert match, "README.md lost its kubectl get example"
    return match.group(1)


def test_readme_kubectl_get_example_is_what_the_code_prints():
    nodes = yaml.safe_load(NODES.read_text())["items"]
    assert readme_block() == kubectl_get([status_of(name, nodes) for name in EXAMPLES])
