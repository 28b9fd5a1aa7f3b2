"""Driver of ``emulated_ranks.cu``: the all-reduce kernels with several ranks on one GPU.

Used by ``test_kernels_emulated.py`` and ``benchmarks/emulated_allreduce.py``. The harness is built
with nvcc against a kernel source folder (the package's ``kernels/csrc`` unless told otherwise)
and driven through ctypes with host arrays.
"""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
from switchyard.kernels import build
from switchyard.kernels.selection import DEFAULT_ONESHOT_BYTES, DEFAULT_TWOSHOT_BYTES

HARNESS = Path(__file__).with_name("emulated_ranks.cu")
KERNELS = {"oneshot": 0, "twoshot": 1, "fused": 2, "fused_partials": 3}
DTYPES = {"float32": (0, np.float32), "bfloat16": (1, ml_dtypes.bfloat16), "float16": (2, np.float16)}
EPS = 1e-5


def rel(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref||."""
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def same_bits(per_rank: np.ndarray) -> bool:
    """Whether every rank's result [rank, ...] has the bits of rank 0's."""
    raw = per_rank.view(np.uint8).reshape(per_rank.shape[0], -1)
    return all(np.array_equal(raw[0], raw[r]) for r in range(1, per_rank.shape[0]))


class HarnessError(RuntimeError):
    """The harness refused a call or a CUDA call failed; the message says which."""


def build_harness(out: Path, csrc: Path = build.CSRC) -> Path:
    """Compile the harness (sm_90a) against the kernel sources in ``csrc``."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        raise HarnessError("nvcc not on PATH")
    cmd = [nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler=-fPIC", "-I", str(csrc),
           "-gencode=arch=compute_90a,code=sm_90a", str(HARNESS), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HarnessError(f"nvcc failed:\n{done.stdout}\n{done.stderr}")
    return out


def load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.emu_last_error.restype = ctypes.c_char_p
    lib.emu_init.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_ulonglong]
    lib.emu_reset.argtypes = [ctypes.c_uint]
    lib.emu_calls.argtypes = [ctypes.c_int]
    lib.emu_calls.restype = ctypes.c_longlong
    vp = ctypes.c_void_p
    lib.emu_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong,
                            ctypes.c_int, ctypes.c_float, ctypes.c_longlong, ctypes.c_int, ctypes.c_int,
                            vp, vp, vp, vp, vp, ctypes.POINTER(ctypes.c_double)]
    return lib


class Emulation:
    """``world`` ranks on the current GPU (one per process and library at a time)."""

    def __init__(self, lib: ctypes.CDLL, world: int, timeout_s: float = 10.0) -> None:
        self.lib, self.world = lib, world
        self._ok(lib.emu_init(world, DEFAULT_ONESHOT_BYTES, DEFAULT_TWOSHOT_BYTES, int(timeout_s * 1e9)))

    def _ok(self, rc: int) -> None:
        if rc != 0:
            raise HarnessError(self.lib.emu_last_error().decode())

    def close(self) -> None:
        self._ok(self.lib.emu_shutdown())

    def reset(self, epoch: int = 0) -> None:
        self._ok(self.lib.emu_reset(epoch))

    def error(self) -> int:
        return int(self.lib.emu_error())

    def calls(self, rank: int) -> int:
        """Rank's launch count, or -1 where its per-block counters disagree."""
        return int(self.lib.emu_calls(rank))

    def run(self, kernel: str, x: np.ndarray, dtype: str, *, residual: np.ndarray | None = None,
            weight: np.ndarray | None = None, calls: int = 1, absent: int = -1, vec: bool = True,
            graph_reps: int = 0) -> tuple[np.ndarray, np.ndarray | None, float]:
        """x: [world, n] (or [world, S, n] float32 partial products); residual [n]; weight [hidden].
        Returns (out [world, n], normed [world, n] or None, µs per call; with ``graph_reps`` the
        median of that many replays of one CUDA graph holding every rank's chain of calls)."""
        code, npt = DTYPES[dtype]
        partials = kernel == "fused_partials"
        xs = np.ascontiguousarray(x, np.float32 if partials else npt)
        n = xs.shape[-1]
        splits = xs.shape[1] if partials else 0
        fused = kernel.startswith("fused")
        hidden = weight.shape[-1] if fused else 0
        res = np.ascontiguousarray(residual, npt) if fused else None
        wt = np.ascontiguousarray(weight, npt) if fused else None
        out = np.empty((self.world, n), npt)
        out2 = np.empty((self.world, n), npt) if fused else None
        us = ctypes.c_double()

        def ptr(a: np.ndarray | None) -> int | None:
            return None if a is None else a.ctypes.data

        self._ok(self.lib.emu_run(KERNELS[kernel], code, int(vec), n, hidden, splits, EPS, calls, absent,
                                  graph_reps, ptr(xs), ptr(res), ptr(wt), ptr(out), ptr(out2), ctypes.byref(us)))
        return out, out2, us.value
