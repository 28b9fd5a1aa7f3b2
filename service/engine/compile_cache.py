"""Compile once per node, not per start: the step programs kept on disk between starts.

Two layers, one folder (``serve --compile-cache DIR``, a node-local volume in a pod):

- XLA's persistent compilation cache (JAX's) under ``DIR/xla-<kernels>``: any program this process
  compiles is looked up by its HLO, compile options, XLA flags, jax and jaxlib versions, platform and
  devices, so a different model shape, layout, jax or GPU never loads another's program. Our kernels'
  custom calls are named in the HLO but implemented by the kernels library, which JAX cannot see: each
  build of the library gets a folder of its own. It is trimmed to :data:`XLA_CACHE_MAX_BYTES` at each
  start. JAX writes its entries in place: a pod that reads one while another pod of the node is still
  writing it logs JAX's warning and compiles that program itself.
- The step programs as loaded executables under ``DIR/programs`` (:class:`ProgramStore`). XLA's cache
  saves the compile but not the tracing and lowering in front of it, which for a 32-layer model is
  most of a warm start; an executable kept whole skips both. Its key is everything a step program is
  built from: the engine's source, the model and layout, the program's shape, the arguments' shapes,
  dtypes and shardings, the compile options and XLA flags, jax, jaxlib, the platform, the devices and
  the kernels library.

Entries are written whole (a temporary file, then renamed), so pods of one node may share the folder
and start at once; an entry that does not load is dropped with one log line and compiled again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pickle
import stat
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV = "SWITCHYARD_COMPILE_CACHE"
# What XLA's cache may hold: at each start, entries beyond it go, least recently written first (a
# Llama-3-8B layout's programs take a few hundred MB; several models and versions fit). JAX's own
# eviction is off: it takes a file lock for every read and write that the compile threads wait on
# for more than its 10 s timeout, and each timeout is a warning and a program not cached.
XLA_CACHE_MAX_BYTES = 16 << 30
STORE_FORMAT = 1
# The code a step program is traced from (relative to the package root): a change to any of it is a
# different program.
PROGRAM_SOURCES = ("service/engine", "service/model", "service/modelspec.py", "kernels")


def file_digest(path: Path | None) -> str:
    """A short digest of a file's bytes (``none`` when there is no such file)."""
    if path is None or not path.is_file():
        return "none"
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def source_digest(root: Path, parts: Sequence[str] = PROGRAM_SOURCES) -> str:
    """A digest of every ``.py`` file under ``parts`` of the package at ``root`` (names and bytes)."""
    digest = hashlib.sha256()
    for part in parts:
        base = root / part
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for f in files:
            digest.update(str(f.relative_to(root)).encode())
            digest.update(f.read_bytes())
    return digest.hexdigest()[:16]


def program_key(facts: Mapping[str, Any]) -> str:
    """The store's key of a program described by ``facts`` (JSON-able values; order does not matter)."""
    text = json.dumps({"format": STORE_FORMAT, **facts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def describe_arguments(tree: Any) -> list[Any]:
    """Every argument leaf's shape, dtype and sharding, and the tree's structure: what a loaded
    executable must be called with."""
    import jax

    leaves, structure = jax.tree_util.tree_flatten(tree)
    return [str(structure)] + [
        [list(x.shape), str(x.dtype), str(getattr(x, "sharding", ""))] for x in leaves
    ]


def stable_repr(value: Any, omit: frozenset[str] = frozenset()) -> str:
    """``value`` as text without memory addresses: functions by their qualified names, dataclasses,
    dicts and sequences item by item; dataclass fields named in ``omit`` left out, at any depth (a
    model's name is not its shape)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = ", ".join(f"{f.name}={stable_repr(getattr(value, f.name), omit)}" for f in dataclasses.fields(value)
                           if f.name not in omit)
        return f"{type(value).__qualname__}({fields})"
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{stable_repr(k, omit)}: {stable_repr(v, omit)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(stable_repr(v, omit) for v in value) + "]"
    return repr(value)


@dataclasses.dataclass(frozen=True)
class WarmUp:
    """An engine's warm-up: ``seconds`` to make ``programs`` step programs ready, of which ``loaded``
    came from the store at ``folder`` (None: no store); the others were compiled (and kept there).
    ``first_runs``: the seconds of those ``seconds`` spent running each program once (a program's first
    launch loads its GPU code and builds its command buffers), of which ``chunk_first_runs`` for the
    ``chunk_programs`` programs that take a prompt chunk (their attention differs from decode's).
    ``autotuner_notices``: XLA's "Delay kernel timed out" lines of the compiles, counted and not shown
    (``service.engine.xla_notices``)."""

    seconds: float
    programs: int
    loaded: int = 0
    folder: Path | None = None
    first_runs: float = 0.0
    chunk_programs: int = 0
    chunk_first_runs: float = 0.0
    autotuner_notices: int = 0

    def describe(self) -> str:
        runs = (f"; first runs {self.first_runs:.1f} s, {self.chunk_first_runs:.1f} s of them for the "
                f"{self.chunk_programs} with a prompt chunk")
        if self.autotuner_notices:
            runs += (f"; XLA's autotuner timed {self.autotuner_notices} candidates with their launch included "
                     "while another compile waited on the GPU (its 'Delay kernel timed out' lines, not shown)")
        if self.folder is None:
            return f"{self.programs} step programs compiled in {self.seconds:.1f} s (no compile cache{runs})"
        return (f"{self.programs} step programs ready in {self.seconds:.1f} s: {self.loaded} loaded from the "
                f"compile cache at {self.folder}, {self.programs - self.loaded} compiled and kept there{runs}")


class ProgramStore:
    """Loaded executables on disk, by :func:`program_key`."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}.exe"

    def load(self, key: str, devices: Sequence[Any]) -> Any | None:
        """The executable kept under ``key``, loaded onto ``devices`` (the program's, in its order), or
        None when there is none or it does not load (then it is dropped)."""
        from jax.experimental import serialize_executable

        path = self._path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            executable, in_tree, out_tree = pickle.loads(blob)
            return serialize_executable.deserialize_and_load(executable, in_tree, out_tree,
                                                             backend=devices[0].client, execution_devices=devices)
        except Exception as err:  # an entry from an incompatible build, or damaged on disk
            log.warning("compile cache: %s does not load (%s: %s); compiling it again", path.name,
                        type(err).__name__, str(err)[:200])
            path.unlink(missing_ok=True)
            return None

    def save(self, key: str, compiled: Any) -> None:
        """Keep ``compiled`` under ``key`` (atomically; a failure to write is logged, not raised)."""
        from jax.experimental import serialize_executable

        tmp: Path | None = None
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(dir=self.folder, prefix=".writing-")
            tmp = Path(name)
            with os.fdopen(fd, "wb") as f:
                f.write(blob)
            os.replace(tmp, self._path(key))
        except Exception as err:
            log.warning("compile cache: could not keep a step program (%s: %s)", type(err).__name__, str(err)[:200])
            if tmp is not None:
                tmp.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """The folder both layers live in (module docstring)."""

    root: Path
    kernels: str  # :func:`file_digest` of the kernels library

    @property
    def xla_folder(self) -> Path:
        return self.root / f"xla-kernels-{self.kernels}"

    @property
    def programs(self) -> ProgramStore:
        return ProgramStore(self.root / "programs")


def open_cache(root: str | os.PathLike[str], kernels_library: Path | None) -> CompileCache:
    """The compile cache at ``root`` (created if missing), with XLA's layer on for the rest of this
    process: every program goes in, however fast it compiled. ``OSError`` if ``root`` cannot be
    created or written."""
    import jax

    cache = CompileCache(Path(root).expanduser().resolve(), file_digest(kernels_library))
    for folder in (cache.xla_folder, cache.programs.folder):
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK):
            raise PermissionError(f"compile cache folder {str(folder)!r} is not writable")
    jax.config.update("jax_compilation_cache_dir", str(cache.xla_folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", -1)
    trim(cache.xla_folder, XLA_CACHE_MAX_BYTES)
    return cache


def trim(folder: Path, max_bytes: int) -> int:
    """Remove the oldest files of ``folder`` (by modification time) until the rest take at most
    ``max_bytes``; the bytes removed. A file another process removes first is skipped."""
    files = []
    for path in folder.iterdir():
        try:
            info = path.stat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(info.st_mode):
            files.append((info.st_mtime, info.st_size, path))
    total, removed = sum(size for _, size, _ in files), 0
    for _, size, path in sorted(files):
        if total - removed <= max_bytes:
            break
        path.unlink(missing_ok=True)
        removed += size
    return removed


def environment_facts(environ: Mapping[str, str], names: Iterable[str]) -> dict[str, str]:
    """The named environment variables that change how programs compile, as they are set."""
    return {name: environ[name] for name in names if name in environ}
