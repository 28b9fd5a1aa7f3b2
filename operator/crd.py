"""The DecodeService CustomResourceDefinition, loaded from the single YAML file packaged here.

``crd.yaml`` is the one source of truth: the operator reads its group/version/plural and every spec
default from it (``spec_default``, ``spec_defaults``, ``object_defaults``), tests validate custom
resources against its ``openAPIV3Schema``, and ``manifests/crds/`` plus the Helm
chart's ``crds/`` are byte-identical copies written by ``python -m switchyard.operator.crd --write DIR``.
Kopf's peering CRD (needed for ``--peering``) ships next to it for the same reason.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
CRD_FILE = HERE / "crd.yaml"
PEERING_CRD_FILE = HERE / "peering-crd.yaml"
RBAC_FILE = HERE / "rbac.yaml"  # the operator's ClusterRole rules, for the chart
# File names of the copies in manifests/crds/ and charts/switchyard/crds/.
COPIES = {CRD_FILE: "switchyard.dev_decodeservices.yaml", PEERING_CRD_FILE: "kopf.dev_clusterkopfpeerings.yaml"}

GROUP = "switchyard.dev"
VERSION = "v1alpha1"
PLURAL = "decodeservices"
KIND = "DecodeService"
API_VERSION = f"{GROUP}/{VERSION}"


@functools.cache
def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def load_crd() -> dict[str, Any]:
    """A fresh copy of the DecodeService CRD manifest."""
    crd = copy.deepcopy(_load(CRD_FILE))
    names = crd["spec"]["names"]
    # The constants above are what the handlers import; keep them honest.
    assert (crd["spec"]["group"], names["plural"], names["kind"]) == (GROUP, PLURAL, KIND)
    assert [v["name"] for v in crd["spec"]["versions"] if v.get("storage")] == [VERSION]
    return crd


def load_peering_crd() -> dict[str, Any]:
    return copy.deepcopy(_load(PEERING_CRD_FILE))


def load_rbac_rules() -> list[dict[str, Any]]:
    return copy.deepcopy(_load(RBAC_FILE))["rules"]


def openapi_schema(version: str = VERSION) -> dict[str, Any]:
    for entry in load_crd()["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise KeyError(f"the CRD has no version {version!r}")


def spec_schema(path: str = "") -> dict[str, Any]:
    """The schema of ``spec.<path>`` (dotted: ``workload.concurrency``), of the spec itself for ``""``."""
    node = openapi_schema()["properties"]["spec"]
    for name in filter(None, path.split(".")):
        node = node["properties"][name]
    return node


def spec_default(path: str) -> Any:
    """The schema's ``default:`` of ``spec.<path>``: the one place a default is written down."""
    schema = spec_schema(path)
    if "default" not in schema:
        raise KeyError(f"the CRD declares no default for spec.{path}")
    return copy.deepcopy(schema["default"])


def spec_defaults(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Apply the schema's ``default:`` values to a spec, as the API server does on admission.

    The handlers call it too, so that a spec written before a default existed reads the same.
    """
    return object_defaults("", spec)


def object_defaults(path: str, value: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The object at ``spec.<path>`` with the schema's defaults applied; an absent object (``None``) reads
    as an empty one, so its fields' defaults still count (the API server defaults only objects present)."""
    return _apply_defaults(spec_schema(path), copy.deepcopy(dict(value or {})))


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    for name, sub in schema.get("properties", {}).items():
        if name not in value and "default" in sub:
            value[name] = copy.deepcopy(sub["default"])
        if name in value:
            value[name] = _apply_defaults(sub, value[name])
    return value


def write_copies(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for source, name in COPIES.items():
        target = directory / name
        target.write_bytes(source.read_bytes())
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="copy the packaged CRDs into a manifests or chart folder")
    parser.add_argument("--write", type=Path, action="append", required=True, metavar="DIR")
    args = parser.parse_args(argv)
    for directory in args.write:
        for path in write_copies(directory):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
