"""Collective layer of the engine (all-reduce, and all-reduce fused with residual add + RMSNorm) and
its decode-attention kernel (``switchyard.kernels.attention``).

Both functions are called inside ``jax.shard_map`` over a mesh axis. Strategies: ``xla`` (psum,
NCCL on GPU), and the custom CUDA kernels of ``kernels/csrc`` (``oneshot``, ``twoshot``, and
``auto``, which picks by message size and GPU count from our benchmark's table). ``init()`` sets
up the GPUs (workspaces, peer access); the first custom all-reduce does it lazily otherwise.

The names below that need JAX load on first use, so that the JAX-free strategy chooser
(``switchyard.kernels.selection``) imports where JAX is absent (the operator's image).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from switchyard.kernels.selection import STRATEGIES

if TYPE_CHECKING:
    from switchyard.kernels import attention, fp8, kv_cache
    from switchyard.kernels.collectives import (
        K_SPLITS,
        SPLIT_MIN_ROWS,
        all_reduce,
        all_reduce_residual_rmsnorm,
        plan,
        rmsnorm,
        row_parallel_residual,
        row_parallel_residual_rmsnorm,
        split_product,
    )
    from switchyard.kernels.native import (
        KernelError,
        attention_ready,
        check_errors,
        device_memory,
        init,
        reset,
        set_timeout,
        status,
    )
    from switchyard.kernels.weights import DenseWeight, Fp8Weight, Weight, as_weight

# Public name -> the module that defines it (a module's own name: the module itself).
_LAZY = {
    "attention": "attention",
    "fp8": "fp8",
    "kv_cache": "kv_cache",
    "all_reduce": "collectives",
    "all_reduce_residual_rmsnorm": "collectives",
    "plan": "collectives",
    "rmsnorm": "collectives",
    "split_product": "collectives",
    # The row-parallel product + all-reduce (+ residual add, + RMSNorm) of a tensor-parallel layer.
    "K_SPLITS": "collectives",
    "SPLIT_MIN_ROWS": "collectives",
    "row_parallel_residual": "collectives",
    "row_parallel_residual_rmsnorm": "collectives",
    # The weight type the model's products and the row-parallel calls take.
    "DenseWeight": "weights",
    "Fp8Weight": "weights",
    "Weight": "weights",
    "as_weight": "weights",
    "KernelError": "native",
    "attention_ready": "native",
    "check_errors": "native",
    "device_memory": "native",
    "init": "native",
    "reset": "native",
    "set_timeout": "native",
    "status": "native",
}

__all__ = [
    "K_SPLITS",
    "SPLIT_MIN_ROWS",
    "STRATEGIES",
    "DenseWeight",
    "Fp8Weight",
    "KernelError",
    "Weight",
    "all_reduce",
    "all_reduce_residual_rmsnorm",
    "as_weight",
    "attention",
    "attention_ready",
    "check_errors",
    "device_memory",
    "fp8",
    "init",
    "kv_cache",
    "plan",
    "reset",
    "rmsnorm",
    "row_parallel_residual",
    "row_parallel_residual_rmsnorm",
    "set_timeout",
    "split_product",
    "status",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    loaded = importlib.import_module(f"{__name__}.{module}")
    value = loaded if module == name else getattr(loaded, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
