"""What the engine asks of XLA's GPU runtime: the allocator its process starts with, and the options
its step programs are compiled with.

A step program runs as CUDA graphs (XLA's command buffers) recorded with the addresses of its
buffers; a launch that finds one moved updates the graph's hundreds of commands first (about 1 ms
of host time, 3-4 ms when the temporary buffer moved: benchmarks/NOTES.md). The paged engine keeps
its inputs and results at fixed addresses; XLA's temporary buffer keeps one only under its
virtual-memory allocator with the ``SKIP_TEMP`` update mode, which maps each launch's temporary
memory at one reserved virtual address per program.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from switchyard.service.modelspec import (
    RUNTIME_RESERVE_BYTES,
    ModelSpecError,
    compiler_room_bytes,
)

ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
# The share of a GPU's memory XLA may take, as JAX reads it (the second name is the older one).
MEMORY_FRACTION_ENVS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
JAX_DEFAULT_MEMORY_FRACTION = 0.75
# What the engine's process lets XLA take: the operator's planner plans each GPU's memory as this
# share (calibration.json's memory_headroom_fraction is the rest), weights, runtime reserve and KV
# pool included.
PROCESS_MEMORY_FRACTION = 0.9
VMM_ALLOCATOR = "vmm"
UPDATE_MODE_OPTION = "xla_gpu_command_buffer_update_mode"
# The temporary buffer at a stable virtual address; parameters and results still update the graph
# when they move.
STABLE_TEMP_UPDATE_MODE = "SKIP_TEMP"
COMMAND_BUFFER_OPTION = "xla_gpu_enable_command_buffer"
# XLA's rematerialization pass fits a program under a limit computed from its own guess of the usable
# memory (80% of the GPU unless the allocator states a limit) less the program's parameters. A step's
# parameters are the weights and the KV pool, which the engine sizes to fill what is free, so the limit
# comes out at zero: the pass can recompute nothing that would help (a step's temporaries are small
# beside the pool) and says so in one warning per program.
DISABLED_PASSES_OPTION = "xla_disable_hlo_passes"
NO_REMATERIALIZATION = "rematerialization"

# A short chunk's step is bound by its launch: outside a command buffer each cuDNN call splits the
# step's graph, and launching and updating the pieces keeps the GPU waiting (a lone 64-token chunk
# step on H200 reached its token in two thirds of the time as one graph). Full chunks keep XLA's
# default set: with cuDNN inside their graphs, the inter-token p99 under load at 12 req/s rose from
# 15 to 20 ms.
SHORT_CHUNK_COMMAND_BUFFER = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"


def apply_process_defaults(environ: dict[str, str] | None = None) -> None:
    """Before JAX starts its GPU client, in an engine's process, unless the user chose: let XLA take
    :data:`PROCESS_MEMORY_FRACTION` of each GPU's memory, through its virtual-memory allocator. That
    allocator keeps no memory statistics and maps memory as it allocates, up to the fraction; the
    paged engine then sizes its KV pool from the driver's free-memory count. With XLA's default
    allocator a step's temporary buffer moves between launches and each launch re-records the step's
    command buffers on every GPU first: at TP=4 the host then sets the step time (benchmarks/NOTES.md)."""
    env = os.environ if environ is None else environ
    if not any(name in env for name in MEMORY_FRACTION_ENVS):
        env[MEMORY_FRACTION_ENVS[0]] = str(PROCESS_MEMORY_FRACTION)
    env.setdefault(ALLOCATOR_ENV, VMM_ALLOCATOR)


def memory_fraction(environ: Mapping[str, str] | None = None) -> float:
    """The share of each GPU's memory JAX's GPU client may allocate in this process."""
    env = os.environ if environ is None else environ
    value = next((env[name] for name in MEMORY_FRACTION_ENVS if env.get(name)), None)
    return float(value) if value is not None else JAX_DEFAULT_MEMORY_FRACTION


def xla_allocator(environ: Mapping[str, str] | None = None) -> str:
    """The allocator JAX's GPU client is asked for in this process (what result files record)."""
    return (os.environ if environ is None else environ).get(ALLOCATOR_ENV, "default").lower()


def step_compiler_options(chunk_tokens: int, step_tokens: int, platform: str,
                          environ: Mapping[str, str]) -> dict[str, str] | None:
    """XLA options of a step program (``chunk_tokens`` 0: decode only), given the process's
    environment. On GPU: a short chunk's step runs as one command buffer, cuDNN included, unless the
    user's XLA_FLAGS choose the command buffers; under the virtual-memory allocator every step keeps
    its temporary buffer at one address, unless XLA_FLAGS choose an update mode; no step runs XLA's
    rematerialization pass, unless XLA_FLAGS choose the disabled passes."""
    if platform != "gpu":
        return None
    xla_flags = environ.get("XLA_FLAGS", "")
    options = {}
    if DISABLED_PASSES_OPTION not in xla_flags:
        options[DISABLED_PASSES_OPTION] = NO_REMATERIALIZATION
    if 0 < chunk_tokens < step_tokens and COMMAND_BUFFER_OPTION not in xla_flags:
        options[COMMAND_BUFFER_OPTION] = SHORT_CHUNK_COMMAND_BUFFER
    if xla_allocator(environ) == VMM_ALLOCATOR and UPDATE_MODE_OPTION not in xla_flags:
        options[UPDATE_MODE_OPTION] = STABLE_TEMP_UPDATE_MODE
    return options or None


def compiler_room(devices: Sequence[Any], driver_count: Callable[[Any], tuple[int, int] | None],
                  weights_per_gpu: int) -> int | None:
    """Bytes the KV pool may take so that XLA's compiler, where the allocator states no limit, sees a
    step's parameters inside the share of memory it assumes usable, on the fullest GPU
    (``modelspec.compiler_room_bytes``, as the planner counts it); None where the allocator states its
    limit (XLA then plans with it) or on host devices."""
    if devices[0].platform != "gpu" or all((d.memory_stats() or {}).get("bytes_limit") for d in devices):
        return None
    counts = [driver_count(d) for d in devices]
    if any(c is None for c in counts):
        return None
    return min(compiler_room_bytes(total, weights_per_gpu) for _, total in counts)


def free_device_memory(devices: Sequence[Any], driver_count: Callable[[Any], tuple[int, int] | None],
                       fraction: float, weights_per_gpu: int) -> int | None:
    """Bytes XLA may still allocate on the fullest of ``devices`` (JAX devices), for the KV pool; None
    on host devices, which have no device memory to fill. What is in use is counted as the planner
    counts it, ``weights_per_gpu`` and :data:`RUNTIME_RESERVE_BYTES`, never as measured: a measured
    count moves from one start to the next (buffers of the load not yet freed, memory an allocator
    keeps for reuse), and another pool size is another set of step programs for the compile cache.
    The share is XLA's arena where its allocator keeps statistics, else ``fraction`` of the GPU; at
    most what is really free: the arena less its bytes in use, or what ``driver_count(device)``
    ((free, total) bytes as the CUDA driver counts them, or None where it cannot tell) says."""
    if devices[0].platform != "gpu":
        return None
    in_use = weights_per_gpu + RUNTIME_RESERVE_BYTES
    stats = [d.memory_stats() for d in devices]
    if all(s and "bytes_limit" in s for s in stats):
        return min(max(0, min(s["bytes_limit"] - s.get("bytes_in_use", 0), s["bytes_limit"] - in_use))
                   for s in stats)
    counts = [driver_count(d) for d in devices]
    if any(c is None for c in counts):
        raise ModelSpecError("cannot size the KV pool: XLA's allocator keeps no memory statistics here and the "
                             "kernels library cannot read the GPUs' free memory (not built, or its query failed); "
                             "set layout.kv_tokens")
    return min(max(0, min(free, int(fraction * total) - in_use)) for free, total in counts)
