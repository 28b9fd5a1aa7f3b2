"""Build the CUDA all-reduce kernels into ``kernels/lib/libswitchyard_kernels.so``.

Run ``python -m switchyard.kernels.build`` (installing the package runs it too, through
``setup.py``, wherever ``nvcc`` is on PATH). The XLA FFI headers come from the installed JAX
(``jax.ffi.include_dir()``), so the library matches the JAX it is loaded into: rebuild after
upgrading JAX. Without ``nvcc`` nothing is built and every strategy runs the pure-JAX reference.

``--diagnostics`` builds the diagnostic library for the benchmarks instead (the same kernels and
handlers plus a device timestamp and the phase-timer reader, ``csrc/ffi_diagnostics.cu``) into
``kernels/lib/diagnostics/``, which the package never ships; ``--phase-timer -o LIB`` adds the
per-phase timers of ``csrc/phase_timer.cuh`` to it.

A library whose inputs have not changed since it was built is not built again: beside it,
``<library>.inputs`` holds a digest of the nvcc command (its output aside), nvcc's version, JAX's
version (the FFI headers) and every file under ``csrc/``.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

CSRC = Path(__file__).resolve().parent / "csrc"
LIB_DIR = Path(__file__).resolve().parent / "lib"
LIB_NAME = "libswitchyard_kernels.so"
# The product library: the registry and C API, the all-reduce and the decode-attention handlers.
SOURCES = ("registry.cu", "ffi_allreduce.cu", "ffi_attention.cu")
# Added in diagnostic builds only (with -DSWITCHYARD_DIAGNOSTICS).
DIAGNOSTIC_SOURCES = ("ffi_diagnostics.cu",)
DIAGNOSTICS = "SWITCHYARD_DIAGNOSTICS"
PHASE_TIMER = "SWITCHYARD_PHASE_TIMER"
# Where benchmarks/allreduce.py builds and loads the diagnostic library (package data takes
# lib/*.so only: never shipped).
DIAGNOSTIC_LIB = LIB_DIR / "diagnostics" / LIB_NAME
# sm_90a for H100/H200 machine code, plus sm_90 machine code and compute_90 PTX so a newer
# Hopper-compatible driver can still load it.
GENCODE = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
)


class BuildError(RuntimeError):
    """nvcc is missing or failed."""


def find_nvcc() -> str | None:
    """``nvcc`` from $CUDA_HOME/bin or PATH, or None."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def ffi_include_dir() -> str:
    import jax.ffi

    return jax.ffi.include_dir()


def nvcc_command(nvcc: str, output: Path, gencode: tuple[str, ...] = GENCODE,
                 defines: tuple[str, ...] = (), diagnostics: bool = False) -> list[str]:
    """The nvcc command line; a phase-timer build is a diagnostic build (its reader lives there)."""
    diagnostics = diagnostics or PHASE_TIMER in defines
    if diagnostics:
        defines = (DIAGNOSTICS, *(d for d in defines if d != DIAGNOSTICS))
    sources = SOURCES + (DIAGNOSTIC_SOURCES if diagnostics else ())
    return [
        nvcc,
        "-std=c++17",
        "-O3",
        # Each architecture's compile (the product has three) on a core of its own.
        "--threads=0",
        "-shared",
        "-Xcompiler=-fPIC,-fvisibility=hidden",
        # The FFI headers trip harmless "missing return" diagnostics in nvcc's front end.
        "-diag-suppress=940,2473",
        "-isystem",
        ffi_include_dir(),
        "-I",
        str(CSRC),
        *gencode,
        *(f"-D{d}" for d in defines),
        *(str(CSRC / s) for s in sources),
        "-o",
        str(output),
    ]


def build(output: Path | None = None, gencode: tuple[str, ...] = GENCODE, verbose: bool = False,
          defines: tuple[str, ...] = (), diagnostics: bool = False) -> Path:
    """Compile the kernels; returns the path of the shared library. Raises BuildError.

    ``diagnostics``: the diagnostic library (``DIAGNOSTIC_SOURCES``; default output
    ``DIAGNOSTIC_LIB``). ``defines``: preprocessor macros, e.g. ``PHASE_TIMER`` for the
    diagnostic build that ``benchmarks/kernel_phases.py`` uses (never the installed library)."""
    if PHASE_TIMER in defines and output is None:
        raise BuildError("a phase-timer build needs its own output path (never a library others load)")
    nvcc = find_nvcc()
    if nvcc is None:
        raise BuildError(
            "nvcc not found (PATH, $CUDA_HOME/bin): the CUDA all-reduce kernels were not built; "
            "every strategy will use the pure-JAX reference path (XLA psum)"
        )
    diagnostics = diagnostics or PHASE_TIMER in defines
    output = output or (DIAGNOSTIC_LIB if diagnostics else LIB_DIR / LIB_NAME)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(f".tmp{os.getpid()}.so")
    cmd = nvcc_command(nvcc, tmp, gencode, defines, diagnostics)
    stamp = output.with_name(output.name + ".inputs")
    digest = inputs_digest(cmd[:-2], nvcc)
    if output.is_file() and stamp.is_file() and stamp.read_text() == digest:
        if verbose:
            print(f"{output} is up to date", file=sys.stderr)
        return output
    if verbose:
        print(" ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise BuildError(f"nvcc failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    os.replace(tmp, output)  # atomic: a process loading the old library never sees half a file
    stamp.write_text(digest)
    return output


def inputs_digest(command: list[str], nvcc: str) -> str:
    """A digest of what a library is built from: ``command`` (the nvcc command without its output),
    nvcc's version, JAX's version and every file under ``csrc/`` (names and bytes)."""
    import jax

    digest = hashlib.sha256()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    for part in (*command, version, jax.__version__):
        digest.update(part.encode() + b"\0")
    for path in sorted(CSRC.rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=None)
    parser.add_argument("--optional", action="store_true", help="exit 0 with a message when nvcc is absent")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("--diagnostics", action="store_true",
                        help=f"the diagnostic library for the benchmarks (default -o {DIAGNOSTIC_LIB})")
    parser.add_argument("--phase-timer", action="store_true",
                        help="diagnostic build with per-phase timers (benchmarks/kernel_phases.py); needs -o")
    args = parser.parse_args(argv)
    if args.phase_timer and args.output is None:
        parser.error("--phase-timer needs -o: the diagnostic library must not replace the installed one")
    try:
        path = build(args.output, verbose=args.verbose, defines=(PHASE_TIMER,) if args.phase_timer else (),
                     diagnostics=args.diagnostics)
    except BuildError as exc:
        print(f"switchyard.kernels.build: {exc}", file=sys.stderr)
        return 0 if args.optional and find_nvcc() is None else 1
    print(f"switchyard.kernels.build: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
