"""The GPU libraries a step program's compile uses, set up on every GPU before programs compile side by
side.

XLA's autotuner times each candidate kernel behind a delay kernel that spins until the host has queued
the candidate's launches, for at most about 100 ms. A library's first set-up on a GPU (cuBLAS handles
and workspaces, cuDNN's handle and the graphs of its attention) waits for the GPU, so when one compile
thread sets a library up while another is timing candidates, the other's delay kernel runs out: XLA
logs "Delay kernel timed out: measured time has sub-optimal accuracy" and that candidate's time is
wrong. One small program that uses the same libraries, compiled and run alone first, sets them up.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard.service.engine.chunk_attention import cudnn_chunk_attention

# Small, but of the kinds a step has: a bf16 product XLA autotunes (cuBLAS and its own GEMM kernels
# are both candidates) and a chunk's attention through cuDNN (its plain and its paged flash attention).
_ROWS, _HIDDEN = 64, 1024
_HEADS, _KV_HEADS, _HEAD_DIM, _BLOCK = 8, 2, 128, 16
_BLOCKS = 2 * _ROWS // _BLOCK  # the chunk's earlier keys fill as many blocks as the chunk


def library_calls(x: jax.Array, w: jax.Array, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                  table: jax.Array, k_chunk: jax.Array, v_chunk: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The program: a product and a chunk's attention (whose earlier keys fill all but the chunk's
    blocks)."""
    kv_len = _BLOCKS * _BLOCK
    attention = cudnn_chunk_attention(q, k_pool, v_pool, table, jnp.int32(kv_len - _ROWS), kv_len, k_chunk, v_chunk)
    return x @ w, attention


def library_inputs(seed: int = 0) -> dict[str, np.ndarray]:
    """The program's inputs, on the host (bf16, the table int32)."""
    rng = np.random.default_rng(seed)
    shapes = {"x": (_ROWS, _HIDDEN), "w": (_HIDDEN, _HIDDEN), "q": (_ROWS, _HEADS, _HEAD_DIM),
              "k_pool": (_BLOCKS, _KV_HEADS, _BLOCK, _HEAD_DIM), "v_pool": (_BLOCKS, _KV_HEADS, _BLOCK, _HEAD_DIM),
              "k_chunk": (_ROWS, _KV_HEADS, _HEAD_DIM), "v_chunk": (_ROWS, _KV_HEADS, _HEAD_DIM)}
    inputs = {name: rng.standard_normal(shape).astype(jnp.bfloat16) for name, shape in shapes.items()}
    return {**inputs, "table": np.arange(_BLOCKS, dtype=np.int32)}


def set_up(mesh: Mesh) -> float | None:
    """Compile and run the libraries' program once on every GPU of ``mesh`` (replicated); the seconds
    it took, or None where the mesh is not of GPUs (nothing to set up)."""
    if mesh.devices.flat[0].platform != "gpu":
        return None
    t0 = time.perf_counter()
    everywhere = NamedSharding(mesh, P())
    args = {name: jax.device_put(value, everywhere) for name, value in library_inputs().items()}
    jax.block_until_ready(jax.jit(library_calls, out_shardings=everywhere)(**args))
    return time.perf_counter() - t0
