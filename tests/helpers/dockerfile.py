"""Reading the images' Dockerfiles: instructions with continuation lines joined and comments dropped."""

from __future__ import annotations

from pathlib import Path

from helpers import ROOT

IMAGES = ROOT / "images"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") or not line.strip():
            continue
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        word, _, rest = pending.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        pending = ""
    return out


def final_stage(path: Path) -> dict[str, str]:
    """ENTRYPOINT, CMD, USER, EXPOSE of the last stage (what the image runs)."""
    found: dict[str, str] = {}
    for word, rest in instructions(path):
        if word == "FROM":
            found = {}
        elif word in ("ENTRYPOINT", "CMD", "USER", "EXPOSE"):
            found[word] = rest
    return found
