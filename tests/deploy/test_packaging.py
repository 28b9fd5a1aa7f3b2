"""The distribution: a wheel carries every module and data file of the four parts, and the command."""

from __future__ import annotations

import subprocess
import sys
import zipfile

from helpers import ROOT

PARTS = {"cli": "switchyard/cli", "kernels": "switchyard/kernels", "service": "switchyard/service",
         "operator": "switchyard/operator"}


def test_wheel_holds_every_module_and_data_file(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("switchyard-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = set()
    for folder, package in PARTS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.suffix in {".py", ".proto", ".yaml", ".json", ".cu", ".cuh"} and "__pycache__" not in path.parts:
                expected.add(f"{package}/{path.relative_to(ROOT / folder).as_posix()}")
    missing = sorted(expected - names)
    assert not missing, f"not in the wheel: {missing}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "switchyard = switchyard.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
