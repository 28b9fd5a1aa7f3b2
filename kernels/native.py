"""Loading, registering and initialising the CUDA kernels (``kernels/lib/libswitchyard_kernels.so``).

Everything here is an I/O edge: the pure decisions live in ``selection.py``. Nothing touches a GPU
until ``init()`` (called explicitly by the engine, or lazily by the first custom all-reduce that is
traced while JAX has GPUs).
"""

from __future__ import annotations

import ctypes
import os
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import jax
from switchyard.kernels.selection import DEFAULT_ONESHOT_BYTES, DEFAULT_TWOSHOT_BYTES, Capability

LIB_NAME = "libswitchyard_kernels.so"

TARGETS = {
    "switchyard_oneshot": "SyOneShot",
    "switchyard_twoshot": "SyTwoShot",
    "switchyard_fused_rmsnorm": "SyFusedRmsNorm",
    "switchyard_decode_attention": "SyDecodeAttention",
    "switchyard_paged_decode_attention": "SyPagedDecodeAttention",
    "switchyard_paged_decode_attention_fp8": "SyPagedDecodeAttentionFp8",
}
# Only in the diagnostic library (``build --diagnostics``, csrc/ffi_diagnostics.cu): registered
# where the loaded library has them.
DIAGNOSTIC_TARGETS = {"switchyard_timestamp": "SyTimestamp"}


class KernelError(RuntimeError):
    """A custom all-reduce failed on the device (e.g. a peer never reached a barrier), or the kernels
    were asked for a group they cannot serve in this process."""


@dataclass
class _State:
    lib: ctypes.CDLL | None = None
    load_error: str | None = None
    registered: bool = False
    capability: Capability = field(default_factory=lambda: Capability.unavailable("not initialised"))
    init_tried: bool = False
    attention: bool | None = None  # decode-attention kernel usable (None: not checked yet)
    ordinals: list[int] | None = None  # the GPUs the kernels were initialised for


_state = _State()
_lock = threading.Lock()


def library_path() -> Path:
    """$SWITCHYARD_KERNELS_LIB, else the library next to this package."""
    env = os.environ.get("SWITCHYARD_KERNELS_LIB")
    return Path(env) if env else Path(__file__).resolve().parent / "lib" / LIB_NAME


def _declare(lib: ctypes.CDLL) -> None:
    lib.sy_last_error.restype = ctypes.c_char_p
    lib.sy_init.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.c_longlong, ctypes.c_longlong]
    lib.sy_init.restype = ctypes.c_int
    lib.sy_error.restype = ctypes.c_int
    lib.sy_reset.argtypes = [ctypes.c_uint]
    lib.sy_reset.restype = ctypes.c_int
    lib.sy_device_calls.argtypes = [ctypes.c_int]
    lib.sy_device_calls.restype = ctypes.c_longlong
    lib.sy_host_calls.restype = ctypes.c_ulonglong
    lib.sy_set_timeout_ns.argtypes = [ctypes.c_ulonglong]
    lib.sy_oneshot_bytes.restype = ctypes.c_longlong
    lib.sy_preload_attention.argtypes = [ctypes.c_int]
    lib.sy_preload_attention.restype = ctypes.c_int
    lib.sy_twoshot_bytes.restype = ctypes.c_longlong
    u64p = ctypes.POINTER(ctypes.c_ulonglong)
    lib.sy_device_memory.argtypes = [ctypes.c_int, u64p, u64p]
    lib.sy_device_memory.restype = ctypes.c_int
    if hasattr(lib, "sy_phase_read"):  # diagnostic builds only
        lib.sy_phase_read.argtypes = [ctypes.c_int, u64p, u64p, u64p]
        lib.sy_phase_read.restype = ctypes.c_int


def _build_on_first_use() -> None:
    """Where the install could not build the kernels (e.g. no JAX in an isolated build env) but
    nvcc is here, build them now (about 15 s, once)."""
    from switchyard.kernels import build

    if build.find_nvcc() is None:
        return
    warnings.warn("switchyard: building the CUDA all-reduce kernels (first use)", stacklevel=3)
    try:
        build.build()
    except build.BuildError as exc:
        warnings.warn(f"switchyard: kernel build failed: {exc}", stacklevel=3)


def load() -> ctypes.CDLL | None:
    """The kernel library, or None (reason in ``status()``) where it is not built or cannot load."""
    with _lock:
        if _state.lib is None and _state.load_error is None:
            path = library_path()
            if not path.exists() and "SWITCHYARD_KERNELS_LIB" not in os.environ:
                _build_on_first_use()
            if not path.exists():
                _state.load_error = f"{path} not built (python -m switchyard.kernels.build)"
            else:
                try:
                    lib = ctypes.CDLL(str(path))
                    _declare(lib)
                    _state.lib = lib
                except OSError as exc:
                    _state.load_error = f"cannot load {path}: {exc}"
        return _state.lib


def _register(lib: ctypes.CDLL) -> None:
    if _state.registered:
        return
    diagnostic = {t: s for t, s in DIAGNOSTIC_TARGETS.items() if hasattr(lib, s)}
    for target, symbol in {**TARGETS, **diagnostic}.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
    _state.registered = True


def _gpu_devices() -> list[jax.Device]:
    """This process's GPUs (in a multi-process group, the others' GPUs are not ours to map)."""
    try:
        return list(jax.local_devices(backend="gpu"))
    except RuntimeError:
        return []


def init(
    devices: list[jax.Device] | None = None,
    oneshot_bytes: int = DEFAULT_ONESHOT_BYTES,
    twoshot_bytes: int = DEFAULT_TWOSHOT_BYTES,
) -> Capability:
    """Give every GPU a workspace and barrier flags, enable peer access between all pairs.

    ``devices``: the GPUs of the tensor-parallel group in rank order (default: all local GPUs).
    Idempotent. Returns the resulting capability; never raises for a missing library or GPU (the
    reference path is used instead, with the reason in ``status()``). Raises :class:`KernelError` for
    a group on other GPUs than the first one initialised in this process.
    """
    with _lock:
        _state.init_tried = True
    devs = list(devices) if devices is not None else _gpu_devices()
    if not devs or any(d.platform != "gpu" for d in devs):
        cap = Capability.unavailable("no GPU devices")
    elif any(d.process_index != jax.process_index() for d in devs):
        cap = Capability.unavailable("the tensor-parallel group spans processes; the kernels need its GPUs in one")
    elif (lib := load()) is None:
        cap = Capability.unavailable(_state.load_error or "library not loaded")
    else:
        ordinals = [int(d.local_hardware_id) for d in devs]
        if _state.ordinals is not None and _state.ordinals != ordinals:
            # The workspaces and peer mappings stay with the first group for the process's life; a
            # silent fall back to psum would time or serve something other than what was asked for.
            raise KernelError(f"the kernels serve GPUs {_state.ordinals} in this process; a tensor-parallel "
                              f"group on GPUs {ordinals} needs a process of its own")
        arr = (ctypes.c_int * len(ordinals))(*ordinals)
        # Make sure JAX's backend (and its CUDA contexts) exist before we allocate on them.
        with _lock:
            rc = lib.sy_init(len(ordinals), arr, int(oneshot_bytes), int(twoshot_bytes))
            if rc != 0:
                cap = Capability.unavailable(f"init failed: {lib.sy_last_error().decode()}")
            else:
                _register(lib)
                _state.ordinals = ordinals
                cap = Capability(
                    available=True,
                    world=len(ordinals),
                    oneshot_bytes=int(lib.sy_oneshot_bytes()),
                    twoshot_bytes=int(lib.sy_twoshot_bytes()),
                    reason="ready",
                )
    with _lock:
        _state.capability = cap
    if not cap.available and devs and devs[0].platform == "gpu":
        warnings.warn(f"switchyard kernels unavailable, using XLA psum: {cap.reason}", stacklevel=2)
    return cap


def attention_ready() -> bool:
    """Whether the decode-attention kernels (contiguous caches and paged pools) can run here: the
    library is loaded, its handlers are registered and its kernels are loaded on this process's GPUs
    (they need no workspace, so no ``init()``). False without GPUs or library; the reference path
    runs instead."""
    if _state.attention is None:
        devs = _gpu_devices()
        lib = load() if devs else None
        ok = False
        if lib is not None:
            with _lock:
                _register(lib)
                ok = all(lib.sy_preload_attention(int(d.local_hardware_id)) == 0 for d in devs)
            if not ok:
                warnings.warn(f"switchyard decode attention unavailable: {lib.sy_last_error().decode()}", stacklevel=2)
        _state.attention = ok
    return _state.attention


def device_memory(device: jax.Device) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU as the CUDA driver counts them, every process's allocations
    included; None where the library is not loaded or the query fails (the reason in a warning)."""
    lib = load()
    if lib is None:
        return None
    free, total = ctypes.c_ulonglong(0), ctypes.c_ulonglong(0)
    if lib.sy_device_memory(int(device.local_hardware_id), ctypes.byref(free), ctypes.byref(total)) != 0:
        warnings.warn(f"switchyard: {lib.sy_last_error().decode()}", stacklevel=2)
        return None
    return free.value, total.value


def capability() -> Capability:
    """What the custom kernels can do in this process; lazily initialises on first use."""
    if not _state.init_tried and _gpu_devices():
        init()
    return _state.capability


def status() -> dict[str, object]:
    cap = _state.capability
    return {
        "library": str(library_path()),
        "loaded": _state.lib is not None,
        "load_error": _state.load_error,
        "available": cap.available,
        "world": cap.world,
        "oneshot_bytes": cap.oneshot_bytes,
        "twoshot_bytes": cap.twoshot_bytes,
        "reason": cap.reason,
    }


def check_errors() -> None:
    """Raise KernelError if any barrier timed out. Reads mapped host memory: no device sync."""
    lib = _state.lib
    if lib is not None and _state.capability.available and lib.sy_error():
        raise KernelError(
            "switchyard all-reduce: a peer GPU never reached a barrier (bounded wait timed out); "
            "outputs since then are invalid; call switchyard.kernels.reset()"
        )


def reset(epoch: int = 0) -> None:
    """Synchronise all GPUs and clear epochs, flags and errors (no all-reduce may be in flight)."""
    lib = _state.lib
    if lib is None or not _state.capability.available:
        return
    if lib.sy_reset(epoch & 0xFFFFFFFF) != 0:
        raise KernelError(lib.sy_last_error().decode())


def set_timeout(seconds: float) -> None:
    """Bounded wait at barriers, captured at trace/record time of each call (default 10 s)."""
    lib = load()
    if lib is not None:
        lib.sy_set_timeout_ns(int(seconds * 1e9))


def device_calls(rank: int) -> int:
    """Launches completed on ``rank`` (synchronous; diagnostics and tests); -1 where its per-block
    launch counters disagree."""
    lib = _state.lib
    return -1 if lib is None else int(lib.sy_device_calls(rank))


def host_calls() -> int:
    """Handler invocations (XLA records a command buffer once and replays it without calling)."""
    lib = _state.lib
    return 0 if lib is None else int(lib.sy_host_calls())


PHASE_SLOTS = 8  # kPhaseSlots in csrc/phase_timer.cuh
PHASE_BLOCKS = 1024  # kPhaseBlocks in csrc/phase_timer.cuh


@dataclass
class PhaseCounters:
    """One GPU's phase timers since the last read (diagnostic builds only, phase_timer.cuh)."""

    block_launches: int
    cycles: list[int]  # per phase slot: sum over block launches of clock64 since the block's start
    ns: list[int]  # the same in %globaltimer ns
    last: list[list[int]]  # per block of the latest launch: %globaltimer at each slot (0 = not reached)


def phase_counters(ordinal: int) -> PhaseCounters | None:
    """Read and clear GPU ``ordinal``'s phase timers (synchronises that GPU). None where the loaded
    library is not the phase-timer build (``python -m switchyard.kernels.build --phase-timer``)."""
    lib = load()
    if lib is None or not hasattr(lib, "sy_phase_read"):
        return None
    cycles = (ctypes.c_ulonglong * PHASE_SLOTS)()
    ns = (ctypes.c_ulonglong * PHASE_SLOTS)()
    last = (ctypes.c_ulonglong * (PHASE_SLOTS * PHASE_BLOCKS))()
    rc = lib.sy_phase_read(ordinal, cycles, ns, last)
    if rc == 1:
        return None
    if rc != 0:
        raise KernelError(lib.sy_last_error().decode())
    return PhaseCounters(
        block_launches=int(cycles[0]), cycles=list(cycles), ns=list(ns),
        last=[list(last[b * PHASE_SLOTS:(b + 1) * PHASE_SLOTS]) for b in range(PHASE_BLOCKS)],
    )


def timestamp(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x, t)``: ``x`` passed through (aliased, no copy) and ``t`` = the GPU's %globaltimer in ns as
    uint32[2] (low, high) when the stream reaches this point. For benchmarks: chaining the
    operations to be timed through ``x`` orders them between two timestamps. CUDA only, and only
    with the diagnostic library loaded (``$SWITCHYARD_KERNELS_LIB``, ``build --diagnostics``)."""
    return jax.ffi.ffi_call(
        "switchyard_timestamp",
        (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct((2,), jax.numpy.uint32)),
        input_output_aliases={0: 0},
    )(x)
