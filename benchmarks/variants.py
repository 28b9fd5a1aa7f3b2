"""Engines that are not the product: the one place where benchmarks and tests build them.

A :class:`Variant` says how an engine departs from the product; :class:`VariantEngine` and
:class:`VariantPipelineEngine` are the product's engine classes with the hooks of their seam
overridden (listed in :class:`~switchyard.service.engine.tensor_parallel.Engine`'s docstring):

- ``_forward_config()``: decode attention through XLA's ops instead of the CUDA kernel; the
  row-parallel products as another number of partial products for the fused all-reduce; or with no
  all-reduce at all (the ``none`` strategy of ``decode.py``: a step whose outputs are meaningless,
  timed to find the all-reduces' share); and the prefill's query-block length;
- ``_new_cache()``: a random KV cache (benchmarks never time on zeros);
- ``_batch_buckets()``: the smallest step batch compiled.

Both classes also have ``occupy_slots``: mark slots active at a context without prefill, so a
benchmark times steps at a long context without running its prompts.

Benchmarks import this file as a sibling module; tests load it with ``helpers.scripts.load("variants")``.
Loaded so, it is not in ``sys.modules``: hence no ``from __future__ import annotations`` here (the
dataclass would look its string annotations up there).
"""

import dataclasses
import functools
import gc
import time
from collections.abc import Sequence
from typing import Self

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels.collectives import MAX_PARTIALS
from switchyard.service.engine.checkpoint import NP_DTYPES
from switchyard.service.engine.heap import freeze_warm_heap
from switchyard.service.engine.model import ForwardConfig
from switchyard.service.engine.paged import PagedEngine
from switchyard.service.engine.pipeline import PipelineEngine, random_stage_weights
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.tensor_parallel import MIN_BATCH_BUCKET, Engine, doubling_buckets, random_weights
from switchyard.service.modelspec import DEFAULT_KV_MEMORY_FRACTION, DEFAULT_STEP_TOKENS, ModelSpec, ServingLayout

ATTENTIONS = ("kernel", "xla")
CACHES = ("random", "zeros")


@dataclasses.dataclass(frozen=True)
class Variant:
    """How an engine departs from the product. ``Variant(cache="zeros")`` is the product."""

    attention: str = "kernel"  # decode attention: the CUDA kernel where it runs ("kernel"), or XLA's ops ("xla")
    k_splits: int = kernels.K_SPLITS  # row-parallel products as this many partial products (1: a plain dot)
    communication: bool = True  # False: the row-parallel products are not summed over the GPUs
    min_batch_bucket: int = MIN_BATCH_BUCKET  # the smallest step batch compiled (tensor-parallel engines)
    cache: str = "random"  # the KV cache's initial values: "random" or "zeros"
    prefill_chunk: int = 1024  # prompts attend in query blocks of this many tokens

    def __post_init__(self) -> None:
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {self.cache!r}")
        if not 1 <= self.k_splits <= MAX_PARTIALS:
            raise ValueError(f"k_splits must be 1..{MAX_PARTIALS}, got {self.k_splits}")
        if self.min_batch_bucket < 1:
            raise ValueError(f"min_batch_bucket must be at least 1, got {self.min_batch_bucket}")

    def forward_config(self, product: ForwardConfig) -> ForwardConfig:
        """The product's forward configuration with this variant's departures; the product's own
        callables where the variant keeps them."""
        changes: dict = {"prefill_chunk": self.prefill_chunk}
        if self.attention == "xla":
            changes["decode_attention"] = functools.partial(kernels.attention.decode_attention_packed,
                                                            use_kernel=False)
            changes["paged_decode_attention"] = functools.partial(kernels.attention.paged_decode_attention_packed,
                                                                  use_kernel=False)
        if not self.communication:
            changes["row_parallel_norm"], changes["row_parallel"] = residual_rmsnorm_unsummed, residual_unsummed
        elif self.k_splits != kernels.K_SPLITS:
            changes["row_parallel_norm"] = functools.partial(kernels.row_parallel_residual_rmsnorm,
                                                             k_splits=self.k_splits)
        return dataclasses.replace(product, **changes)


def residual_rmsnorm_unsummed(a: jax.Array, w: jax.Array, residual: jax.Array, weight: jax.Array, eps: float,
                              axis: str, strategy: str) -> tuple[jax.Array, jax.Array]:
    """As ``kernels.row_parallel_residual_rmsnorm`` without the all-reduce: each GPU keeps its own
    partial product (residual add and RMSNorm stay, in XLA)."""
    new_residual = residual + (a @ w).astype(residual.dtype)
    return new_residual, kernels.rmsnorm(new_residual, weight, eps)


def residual_unsummed(a: jax.Array, w: jax.Array, residual: jax.Array, axis: str, strategy: str) -> jax.Array:
    """As ``kernels.row_parallel_residual`` without the all-reduce."""
    return residual + (a @ w).astype(residual.dtype)


def random_cache(shape: tuple[int, ...], sharding: NamedSharding, dtype: str,
                 layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per-layer K and V caches of random values, made on the devices."""
    jdtype = jnp.dtype(NP_DTYPES[dtype])
    make = jax.jit(lambda key: (jax.random.normal(key, shape, jnp.float32) * 0.5).astype(jdtype),
                   out_shardings=sharding)
    return ([make(jax.random.PRNGKey(2 * i)) for i in range(layers)],
            [make(jax.random.PRNGKey(2 * i + 1)) for i in range(layers)])


class _Variant:
    """What both variant engines add to the product's class: the ``variant`` they are built as, the
    seam's hooks it overrides, and ``occupy_slots``, which writes the per-slot entries of the device
    state ``_state`` and the slot book's host mirror."""

    mesh: Mesh
    spec: ModelSpec
    dtype: str
    max_slots: int
    max_seq_len: int
    active: np.ndarray
    greedy: np.ndarray
    positions: np.ndarray
    _state: dict
    variant: Variant
    # (spec, layout, dtype, seed, devices) -> (params, mesh): each engine class says how its weights are made
    random_weights: staticmethod

    def __init__(self, spec: ModelSpec, params: dict, mesh: Mesh, *, batch_slots: int, max_seq_len: int,
                 strategy: str = "xla", dtype: str | None = None, variant: Variant = Variant()) -> None:
        self.variant = variant  # the hooks below run in the product's constructor
        super().__init__(spec, params, mesh, batch_slots=batch_slots, max_seq_len=max_seq_len, strategy=strategy,
                         dtype=dtype)

    @classmethod
    def from_random(cls, spec: ModelSpec, layout: ServingLayout, dtype: str = "bfloat16", seed: int = 0,
                    devices: Sequence[jax.Device] | None = None, *, variant: Variant = Variant()) -> Self:
        params, mesh = cls.random_weights(spec, layout, dtype, seed, devices)
        return cls(spec, params, mesh, batch_slots=layout.batch_slots, max_seq_len=layout.max_seq_len,
                   strategy=layout.strategy, dtype=dtype, variant=variant)

    def _forward_config(self) -> ForwardConfig:
        return self.variant.forward_config(super()._forward_config())

    def _new_cache(self, shape: tuple[int, ...], sharding: NamedSharding,
                   layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
        if self.variant.cache == "random":
            return random_cache(shape, sharding, self.dtype, layers)
        return super()._new_cache(shape, sharding, layers)

    def occupy_slots(self, context: int, count: int | None = None, sampling: SamplingParams | None = None) -> None:
        """Mark the first ``count`` slots (all by default) active at ``context`` tokens of whatever the
        cache holds, without prefill."""
        if not 1 <= context < self.max_seq_len:
            raise ValueError(f"context must be in [1, {self.max_seq_len})")
        count = self.max_slots if count is None else count
        s = sampling or SamplingParams()
        n = self.max_slots
        rep = NamedSharding(self.mesh, P())
        self._state = dict(self._state)
        for key, value in (("positions", np.full(n, context, np.int32)), ("counters", np.ones(n, np.int32)),
                           ("temperature", np.full(n, s.temperature, np.float32)),
                           ("top_k", np.full(n, s.top_k, np.int32)), ("top_p", np.full(n, s.top_p, np.float32)),
                           ("seeds", np.full(n, s.seed, np.int32)),
                           ("tokens", np.arange(n, dtype=np.int32) % self.spec.vocab_size)):
            self._state[key] = jax.device_put(value, rep)
        self.active[:] = False
        self.active[:count] = True
        self.greedy[:] = s.greedy
        self.positions[:] = context


def _tensor_parallel_weights(spec: ModelSpec, layout: ServingLayout, dtype: str, seed: int,
                             devices: Sequence[jax.Device] | None) -> tuple[dict, Mesh]:
    return random_weights(spec, layout.tp, dtype, seed, devices)


class VariantEngine(_Variant, Engine):
    """A tensor-parallel :class:`Engine` built as ``variant`` says."""

    random_weights = staticmethod(_tensor_parallel_weights)

    def _batch_buckets(self) -> list[int]:
        return doubling_buckets(self.max_slots, min(self.variant.min_batch_bucket, self.max_slots))


class VariantPipelineEngine(_Variant, PipelineEngine):
    """A :class:`PipelineEngine` built as ``variant`` says (its ``min_batch_bucket`` does not apply:
    every tick runs a whole micro-batch)."""

    random_weights = staticmethod(random_stage_weights)


def serving_tokenizer(args) -> tuple:
    """The model spec and tokenizer of :func:`serving_engine`'s engine, with no device touched."""
    from switchyard.service.engine.tokenizer import Tokenizer, build_tokenizer
    from switchyard.service.modelspec import ModelSpec, preset

    if args.model_path:
        return ModelSpec.from_file(args.model_path), Tokenizer.from_dir(args.model_path)
    spec = preset(args.preset)
    return spec, Tokenizer(build_tokenizer(spec), spec.eos_token_ids, spec.vocab_size)


def serving_engine(args) -> tuple:
    """The warmed-up engine, its tokenizer and the warm-up's seconds, for a serving benchmark (``args``:
    ``model_path`` or ``preset``, ``tp``, ``strategy``, ``batch_slots``, ``max_seq_len``, ``dtype``): a checkpoint's, as
    ``switchyard serve`` loads it, or random weights of a preset with a random KV cache (benchmarks
    never time on zeros)."""
    spec, tokenizer = serving_tokenizer(args)
    layout = ServingLayout(tp=args.tp, strategy=args.strategy, batch_slots=args.batch_slots,
                           max_seq_len=args.max_seq_len, kv_tokens=getattr(args, "kv_tokens", 0),
                           kv_memory_fraction=getattr(args, "kv_memory_fraction", DEFAULT_KV_MEMORY_FRACTION),
                           step_tokens=getattr(args, "step_tokens", DEFAULT_STEP_TOKENS))
    paged = getattr(args, "engine", "paged") == "paged"
    if args.model_path:
        cls = PagedEngine if paged else Engine
        engine = cls.from_checkpoint(args.model_path, layout, dtype=args.dtype, progress=False)
    elif paged:
        engine = PagedEngine.from_random(spec, layout, dtype=args.dtype or spec.dtype)
    else:
        engine = VariantEngine.from_random(spec, layout, dtype=args.dtype or spec.dtype)
    if paged:
        print(f"KV pool: {engine.kv_tokens} tokens in blocks of {engine.kv_block_size} "
              f"({engine.kv_tokens / layout.max_seq_len:.1f} sequences at the full context); "
              f"steps carry up to {engine.step_tokens} prompt tokens", flush=True)
    warmup_s = engine.warmup()
    print(f"warm-up: {warmup_s:.1f} s", flush=True)
    frozen, collect_ms = freeze_warm_heap()  # as switchyard serve does
    t0 = time.perf_counter()
    gc.collect()
    print(f"heap: {frozen} objects frozen; a full collection took {collect_ms:.0f} ms before, "
          f"{1e3 * (time.perf_counter() - t0):.1f} ms after", flush=True)
    return engine, tokenizer, warmup_s


def occupy_paged(engine: PagedEngine, context: int, count: int, seed: int = 0) -> None:
    """Mark slots ``[0, count)`` of a paged engine decoding at ``context`` without running prompts:
    each gets the blocks its context and every later position need (so timed steps take none), the
    pool gets random values, and the device state the positions. For decode-step benchmarks."""
    from switchyard.service.engine.kv_blocks import SequenceBlocks
    from switchyard.service.engine.paged import _Sequence

    room = engine.max_seq_len
    for slot in range(count):
        seq = _Sequence([0] * context, SamplingParams(), 0, SequenceBlocks(), context, reuse_prefix=False)
        if not engine.pool.grow(seq.blocks, room):
            raise ValueError(f"the pool has too few blocks for {count} sequences of {room} tokens")
        engine._seqs[slot] = seq
        engine.active[slot] = True
        engine._decoding[slot] = True
        engine.positions[slot] = context
        engine._set_table(slot)
    state = dict(engine._state)
    key = jax.random.PRNGKey(seed)
    for name in ("k", "v"):
        state[name] = [
            jax.jit(lambda k, shape=c.shape, dtype=c.dtype: jax.random.normal(k, shape, jnp.float32).astype(dtype),
                    out_shardings=c.sharding)(jax.random.fold_in(key, i + (0 if name == "k" else 10_000)))
            for i, c in enumerate(engine._state[name])]
    state["positions"] = jax.device_put(np.where(np.arange(engine.max_slots) < count, context, 0).astype(np.int32),
                                        engine._state["positions"].sharding)
    engine._state = state
