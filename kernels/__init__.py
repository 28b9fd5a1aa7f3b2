"""Collective layer of the engine: all-reduce and all-reduce fused with residual add + RMSNorm.

Both functions are called inside ``jax.shard_map`` over a mesh axis. Strategies: ``xla`` (psum,
NCCL on GPU), and the custom CUDA kernels added alongside (``oneshot``, ``twoshot``, ``auto``).
"""

from switchyard.kernels.collectives import (
    STRATEGIES,
    all_reduce,
    all_reduce_residual_rmsnorm,
    rmsnorm,
)

__all__ = ["STRATEGIES", "all_reduce", "all_reduce_residual_rmsnorm", "rmsnorm"]
