"""Collective layer of the engine (all-reduce, and all-reduce fused with residual add + RMSNorm) and
its decode-attention kernel (``switchyard.kernels.attention``).

Both functions are called inside ``jax.shard_map`` over a mesh axis. Strategies: ``xla`` (psum,
NCCL on GPU), and the custom CUDA kernels of ``kernels/csrc`` (``oneshot``, ``twoshot``, and
``auto``, which picks by message size and GPU count from our benchmark's table). ``init()`` sets
up the GPUs (workspaces, peer access); the first custom all-reduce does it lazily otherwise.
"""

from switchyard.kernels import attention
from switchyard.kernels.collectives import (
    STRATEGIES,
    all_reduce,
    all_reduce_residual_rmsnorm,
    plan,
    rmsnorm,
    split_product,
)
from switchyard.kernels.native import KernelError, check_errors, init, reset, set_timeout, status

__all__ = [
    "STRATEGIES",
    "KernelError",
    "all_reduce",
    "all_reduce_residual_rmsnorm",
    "attention",
    "check_errors",
    "init",
    "plan",
    "reset",
    "rmsnorm",
    "set_timeout",
    "split_product",
    "status",
]

# The row-parallel product + all-reduce (+ residual add, + RMSNorm) of a tensor-parallel layer.
from switchyard.kernels.collectives import (
    K_SPLITS,
    row_parallel_residual,
    row_parallel_residual_rmsnorm,
)

__all__ += ["K_SPLITS", "row_parallel_residual", "row_parallel_residual_rmsnorm"]
