"""An image's Python layer, built on this machine by following its Dockerfile: every COPY from the
build context, WORKDIR, ENV and RUN of every stage, in order, with the container's absolute paths moved
under a scratch root, and its Python a fresh virtual environment of the images' Python version.

RUN lines that install the operating system's packages or need the image's CUDA toolchain are not run;
:func:`build` returns them, so a test can say exactly what it left out."""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from helpers import ROOT
from helpers.dockerfile import IMAGES, instructions

# RUN lines left to the base image or to a GPU build host: (pattern, why).
NOT_RUN = [
    (r"apt-get ", "operating-system packages: the base image's, here a fresh virtual environment"),
    (r"python -m switchyard\.kernels\.build", "compiles the CUDA kernels with the image's nvcc"),
]
# What pip may take from this machine's environment: how to reach the package index, nothing that
# changes what is installed (this machine's pip configuration files, find-links and constraints are not
# the image's, so pip reads no configuration file).
PASSED_THROUGH = ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
                  "PIP_INDEX_URL", "PIP_CERT", "PIP_DEFAULT_TIMEOUT", "SSL_CERT_FILE", "SSL_CERT_DIR",
                  "REQUESTS_CA_BUNDLE")
ABSOLUTE = re.compile(r"(?<![\w.$/-])(/[A-Za-z0-9_.*-]+(?:/[A-Za-z0-9_.*-]*)*)")


@dataclasses.dataclass
class Layer:
    image: str
    root: Path  # the container's / lies here
    env: dict[str, str]  # the final stage's environment (PATH leads to the image's `switchyard`)
    not_run: list[str]  # the RUN lines left out

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """A command in the built layer, as the image's entry point runs it (from an empty folder)."""
        home = self.root / "run"
        home.mkdir(exist_ok=True)
        return subprocess.run(list(argv), cwd=home, env=self.env, capture_output=True, text=True, timeout=timeout)


def images_python(version: str) -> str | None:
    """A CPython ``version`` interpreter on this machine (on PATH, or one of pyenv's), or None."""
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    candidates = [shutil.which(f"python{version}"),
                  *sorted(glob.glob(f"{pyenv}/versions/{version}*/bin/python{version}"))]
    for candidate in filter(None, candidates):
        done = subprocess.run([candidate, "-c", "import sys, venv, ensurepip; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, cwd="/", timeout=60)
        if done.returncode == 0 and done.stdout.strip() == version:
            return candidate
    return None


def expand(value: str, env: dict[str, str]) -> str:
    """``$NAME`` in an ENV value, from the stage's environment so far."""
    return re.sub(r"\$(\w+)", lambda m: env.get(m.group(1), ""), value)


def inside(root: Path, text: str) -> str:
    """``text`` with every absolute path of the container moved under ``root`` (/dev stays)."""
    return ABSOLUTE.sub(lambda m: m.group(1) if m.group(1).startswith("/dev/") else f"{root}{m.group(1)}", text)


def build(image: str, root: Path, python: str, lock_text: Callable[[str], str] = lambda text: text,
          log: Callable[[str], None] = lambda line: None) -> Layer:
    """Follow ``images/IMAGE/Dockerfile`` under ``root``; ``lock_text`` may change the lock as it is
    copied. Raises AssertionError with the failing step's output."""
    system = root / "python"  # the base image's Python
    subprocess.run([python, "-m", "venv", str(system)], check=True, cwd="/", timeout=300)
    base_env = {"PATH": f"{system}/bin:/usr/bin:/bin", "HOME": str(root / "home"), "LANG": "C.UTF-8",
                "PIP_CONFIG_FILE": os.devnull,
                **{k: os.environ[k] for k in PASSED_THROUGH if k in os.environ}}
    (root / "home").mkdir(parents=True, exist_ok=True)
    env, workdir, not_run = dict(base_env), root, []
    for word, rest in instructions(IMAGES / image / "Dockerfile"):
        if word == "FROM":
            env, workdir = dict(base_env), root
        elif word == "WORKDIR":
            workdir = Path(inside(root, rest))
            workdir.mkdir(parents=True, exist_ok=True)
        elif word == "ENV":
            for name, value in re.findall(r"(\w+)=(\S+)", rest):
                env[name] = expand(inside(root, value), env)
        elif word == "COPY":
            _copy(rest, root, workdir, lock_text)
        elif word == "RUN":
            if any(re.search(pattern, rest) for pattern, _ in NOT_RUN):
                not_run.append(rest)
                continue
            log(f"RUN {rest}")
            done = subprocess.run(["/bin/sh", "-c", inside(root, rest)], cwd=workdir, env=env, capture_output=True,
                                  text=True, timeout=1500)
            assert done.returncode == 0, f"{image}: RUN {rest}\nexit {done.returncode}\n{done.stdout[-3000:]}" \
                                         f"\n{done.stderr[-5000:]}"
    return Layer(image, root, env, not_run)


def _copy(rest: str, root: Path, workdir: Path, lock_text: Callable[[str], str]) -> None:
    *sources, dest = rest.split()
    if sources[0].startswith("--from="):
        # A path of an earlier stage: every stage shares the scratch root, so it is already in place.
        assert all(inside(root, s) == inside(root, dest) for s in sources[1:]), f"COPY {rest}: no emulation"
        return
    target = Path(inside(root, dest)) if dest.startswith("/") else workdir / dest
    for source in sources:
        src = ROOT / source
        into = target / src.name if dest.endswith("/") or len(sources) > 1 else target
        if src.is_dir():
            shutil.copytree(src, into, ignore=lambda folder, names: [
                n for n in names if ignored((Path(folder) / n).relative_to(ROOT).as_posix())])
        else:
            into.parent.mkdir(parents=True, exist_ok=True)
            text = src.read_text()
            into.write_text(lock_text(text) if src.name == "requirements.lock" else text)


def ignored(relative: str) -> bool:
    """Whether the build context leaves this path out (.dockerignore; ``**/`` matches any depth)."""
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatchcase(part, pattern[3:]) for part in relative.split("/")):
                return True
        elif fnmatch.fnmatchcase(relative, pattern):
            return True
    return False
