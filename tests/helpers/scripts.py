"""The repository's scripts (benchmarks/*.py, scripts/*.py) as modules: they are run as files, not
installed, and tests import them for their pure parts."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from helpers import ROOT

BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = ROOT / "scripts"


def load(name: str, folder=BENCHMARKS) -> ModuleType:
    """``folder/<name>.py`` (benchmarks/ by default), imported under that name."""
    spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
