"""The decode engine: fixed slots, ``prefill`` / ``insert`` / ``generate`` / ``evict``.

All per-slot decode state (KV cache, last token, position, sampling parameters) lives on the devices
and is donated to each step, so a steady-state step moves nothing from host to device and brings back
one token per slot. Steps are compiled once per batch bucket (the smallest bucket covering the highest
occupied slot) and per sampling mode (all-greedy, or sampled); prompts are padded to length buckets.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels.selection import check_strategy
from switchyard.service.engine.checkpoint import NP_DTYPES, load_params
from switchyard.service.engine.contract import DecodeEngine, PendingStep, Prefix, StepResult
from switchyard.service.engine.model import (
    AXIS,
    ForwardConfig,
    ShardShape,
    decode_forward,
    param_shapes,
    param_specs,
    prefill_forward,
)
from switchyard.service.engine.sampling import SamplingParams, sample_sharded
from switchyard.service.errors import InvalidRequestError, OutOfRangeError
from switchyard.service.modelspec import ModelSpec, ServingLayout

CACHE_SPEC = P(None, AXIS, None, None)  # [slots, kv_heads, max_seq, head_dim], sharded by KV head
MIN_PREFILL_BUCKET = 16
# A step for one sequence runs as two rows: XLA on GPU compiles some [1, K] x [K, N] products as a
# broadcast-multiply plus reduce that writes a K x N temporary (see benchmarks/NOTES.md).
MIN_BATCH_BUCKET = 2
CACHE_ALIGN = 128  # positions; the cache length is a multiple of this


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ValueError(f"tensor-parallel size {tp} needs {tp} devices; this process sees {len(devices)}")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def doubling_buckets(limit: int, start: int) -> list[int]:
    """``start``, doubled while below ``limit``, then ``limit``: the sizes programs are compiled for."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


class SlotBook:
    """Host-side bookkeeping shared by the engines: slots, their occupancy and insert counts, prompt
    checks and bucketing, and the table of compiled programs. Uses only its own state."""

    def __init__(self, spec: ModelSpec, batch_slots: int, max_seq_len: int) -> None:
        if batch_slots < 1:
            raise ValueError(f"batch_slots must be at least 1, got {batch_slots}")
        if not 2 <= max_seq_len <= spec.max_position_embeddings:
            raise ValueError(
                f"max_seq_len must be in [2, {spec.max_position_embeddings}] for {spec.name}, got {max_seq_len}")
        self.spec = spec
        self.max_slots = batch_slots
        self.max_seq_len = max_seq_len
        self.prefill_buckets = doubling_buckets(max_seq_len, min(MIN_PREFILL_BUCKET, max_seq_len))
        self._jits: dict[tuple, Any] = {}
        self.active = np.zeros(batch_slots, dtype=bool)
        self.greedy = np.ones(batch_slots, dtype=bool)
        self.positions = np.zeros(batch_slots, dtype=np.int64)  # host mirror: next position to write
        self.generation = np.zeros(batch_slots, dtype=np.int64)  # inserts per slot
        self.step_count = 0

    def validate_prompt(self, tokens: Sequence[int]) -> None:
        if len(tokens) == 0:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if len(tokens) >= self.max_seq_len:
            raise OutOfRangeError(
                f"prompt has {len(tokens)} tokens; this deployment's context is {self.max_seq_len} tokens, "
                f"so a prompt may have at most {self.max_seq_len - 1}")
        bad = [t for t in tokens if not 0 <= int(t) < self.spec.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token ids must be in [0, {self.spec.vocab_size}); got {bad[:5]}{'...' if len(bad) > 5 else ''}")

    def padded_prompt(self, tokens: Sequence[int], sampling: SamplingParams) -> np.ndarray:
        """Validate a request and pad its prompt to the smallest prefill bucket that holds it."""
        sampling.validate()
        self.validate_prompt(tokens)
        bucket = next(b for b in self.prefill_buckets if b >= len(tokens))
        padded = np.zeros(bucket, np.int32)
        padded[: len(tokens)] = tokens
        return padded

    def free_slots(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(~self.active)]

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds: every slot reserves its whole context."""
        return self.max_slots * self.max_seq_len

    @property
    def kv_block_size(self) -> int:
        """Positions per KV block: here a block is a slot's whole context."""
        return self.max_seq_len

    @property
    def step_tokens(self) -> int:
        """Prompt tokens a step carries beside the decode tokens; 0: prompts are prefilled whole."""
        return 0

    def check_free(self, slot: int) -> None:
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.max_slots})")
        if self.active[slot]:
            raise ValueError(f"slot {slot} is occupied")

    def mark_inserted(self, prefix: Prefix, slot: int) -> None:
        self.active[slot] = True
        self.generation[slot] += 1
        self.greedy[slot] = prefix.sampling.greedy
        self.positions[slot] = prefix.length

    def evict(self, slot: int) -> None:
        """Free a slot; its stale cache is overwritten by the next insert."""
        self.active[slot] = False

    def room(self, slot: int) -> int:
        """How many more tokens the slot can generate before its context is full."""
        return int(self.max_seq_len - self.positions[slot])

    def slot_generation(self, slot: int) -> int:
        """The slot's insert count."""
        return int(self.generation[slot])

    def greedy_only(self) -> bool:
        occupied = np.flatnonzero(self.active)
        return bool(self.greedy[occupied].all()) if occupied.size else True

    def _compiled(self, key: tuple, build) -> Any:
        fn = self._jits.get(key)
        if fn is None:
            fn = self._jits[key] = build()
        return fn

    def compiled_count(self) -> int:
        """Compiled executables across all program tables (tests assert it stays flat after warm-up)."""
        return sum(fn._cache_size() for fn in self._jits.values())


class Engine(SlotBook):
    """The decode engine of one tensor-parallel group (see the module docstring); implements
    :class:`~switchyard.service.engine.contract.DecodeEngine`.

    The seam for benchmark variants (``benchmarks/variants.py``): the constructor calls three hook
    methods, once each, that a subclass may override to build an engine that is not the product:

    - ``_forward_config()``: the :class:`ForwardConfig` of every compiled program (its callables:
      decode attention, the row-parallel products with their all-reduce);
    - ``_new_cache(shape, sharding, layers)``: the per-layer K and V caches it starts with;
    - ``_batch_buckets()``: the step batches it compiles (ascending; the last is ``max_slots``).

    A variant may also replace entries of the device state ``_state`` (the per-slot arrays that
    ``_new_state`` makes, replicated over ``mesh``) together with the slot book's host mirror.
    Nothing else is meant to be overridden.
    """

    def __init__(
        self,
        spec: ModelSpec,
        params: dict,
        mesh: Mesh,
        *,
        batch_slots: int,
        max_seq_len: int,
        strategy: str = "xla",
        dtype: str | None = None,
    ) -> None:
        check_strategy(strategy)
        super().__init__(spec, batch_slots, max_seq_len)
        self.params = params
        self.mesh = mesh
        self.tp = mesh.shape[AXIS]
        self.strategy = strategy
        self.dtype = dtype or spec.dtype
        self.shape = ShardShape(spec, self.tp)
        self._cfg = self._forward_config()
        self._pspecs = param_specs(spec)
        self.batch_buckets = self._batch_buckets()
        if strategy != "xla" and self.tp > 1:
            # Workspaces and peer access for the custom all-reduce, on exactly this mesh's GPUs and
            # before any step is compiled (no-op, with the reason in kernels.status(), off GPU).
            kernels.init(list(mesh.devices.flat))
        self._state = self._new_state()

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(
        cls, path: str | Path, layout: ServingLayout, dtype: str | None = None,
        devices: Sequence[jax.Device] | None = None, progress: bool = True,
    ) -> Engine:
        spec = ModelSpec.from_file(path)
        dtype = dtype or spec.dtype
        mesh = make_mesh(layout.tp, devices)
        ShardShape(spec, layout.tp)  # clear error before any loading
        params = load_params(path, spec, mesh, dtype, progress=progress)
        return cls(spec, params, mesh, batch_slots=layout.batch_slots, max_seq_len=layout.max_seq_len,
                   strategy=layout.strategy, dtype=dtype)

    @classmethod
    def from_random(
        cls, spec: ModelSpec, layout: ServingLayout, dtype: str = "bfloat16", seed: int = 0,
        devices: Sequence[jax.Device] | None = None,
    ) -> Engine:
        """Random weights made on the devices, shard by shard (for benchmarks of large shapes)."""
        params, mesh = random_weights(spec, layout.tp, dtype, seed, devices)
        return cls(spec, params, mesh, batch_slots=layout.batch_slots, max_seq_len=layout.max_seq_len,
                   strategy=layout.strategy, dtype=dtype)

    # ---- the seam for benchmark variants (see the class docstring) ----------------------------------
    def _forward_config(self) -> ForwardConfig:
        return ForwardConfig.make(self.shape, self.strategy)

    def _new_cache(self, shape: tuple[int, ...], sharding: NamedSharding,
                   layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
        return new_cache(shape, sharding, self.dtype, layers)

    def _batch_buckets(self) -> list[int]:
        return doubling_buckets(self.max_slots, min(MIN_BATCH_BUCKET, self.max_slots))

    def _new_state(self) -> dict[str, Any]:
        s = self.spec
        # Round the cache length up so attention's matrix products need no padded copy of the cache.
        cache_len = -(-self.max_seq_len // CACHE_ALIGN) * CACHE_ALIGN
        cache_shape = (self.max_slots, s.num_kv_heads, cache_len, s.head_dim)
        k, v = self._new_cache(cache_shape, NamedSharding(self.mesh, CACHE_SPEC), s.num_layers)
        return {"k": k, "v": v, **slot_state(self.mesh, self.max_slots)}

    @functools.cached_property
    def _state_shardings(self) -> dict[str, Any]:
        cache = NamedSharding(self.mesh, CACHE_SPEC)
        rep = NamedSharding(self.mesh, P())
        return {key: ([cache] * self.spec.num_layers if key in ("k", "v") else rep) for key in self._state}

    # ---- compiled functions ------------------------------------------------------------------------
    def _step_fn(self, batch: int, greedy_only: bool, return_logits: bool):
        return self._compiled(("step", batch, greedy_only, return_logits),
                              lambda: self._build_step(batch, greedy_only, return_logits))

    def _prefill_fn(self, bucket: int, greedy_only: bool, return_logits: bool):
        return self._compiled(("prefill", bucket, greedy_only, return_logits),
                              lambda: self._build_prefill(greedy_only, return_logits))

    def _insert_fn(self, bucket: int):
        return self._compiled(("insert", bucket), self._build_insert)

    def _build_step(self, batch: int, greedy_only: bool, return_logits: bool):
        cfg, vocab = self._cfg, self.spec.vocab_size
        cache_specs = [CACHE_SPEC] * self.spec.num_layers

        def shard_fn(params, k, v, tokens, positions, temp, top_k, top_p, seeds, counters):
            logits, k, v = decode_forward(params, k, v, tokens, positions, cfg)
            tok = sample_sharded(logits, vocab, AXIS, greedy_only=greedy_only, temperature=temp, top_k=top_k,
                                 top_p=top_p, seeds=seeds, counters=counters)
            full = jax.lax.all_gather(logits, AXIS, axis=1, tiled=True) if return_logits else jnp.zeros(())
            return tok, full, k, v

        mapped = jax.shard_map(
            shard_fn, mesh=self.mesh,
            in_specs=(self._pspecs, cache_specs, cache_specs, P(), P(), P(), P(), P(), P(), P()),
            out_specs=(P(), P(), cache_specs, cache_specs), check_vma=False)
        last = self.max_seq_len - 1

        def step(params, state):
            b = slice(0, batch)
            tok, logits, k, v = mapped(params, state["k"], state["v"], state["tokens"][b], state["positions"][b],
                                       state["temperature"][b], state["top_k"][b], state["top_p"][b],
                                       state["seeds"][b], state["counters"][b])
            new = dict(state, k=k, v=v)
            new["tokens"] = state["tokens"].at[b].set(tok)
            new["positions"] = state["positions"].at[b].set(jnp.minimum(state["positions"][b] + 1, last))
            new["counters"] = state["counters"].at[b].add(1)
            return new, tok, logits

        return jax.jit(step, donate_argnums=(1,), out_shardings=(self._state_shardings, None, None))

    def _build_prefill(self, greedy_only: bool, return_logits: bool):
        cfg, vocab = self._cfg, self.spec.vocab_size

        def shard_fn(params, tokens, length, temp, top_k, top_p, seed):
            logits, ks, vs = prefill_forward(params, tokens, length, cfg)
            tok = sample_sharded(logits[None], vocab, AXIS, greedy_only=greedy_only, temperature=temp,
                                 top_k=top_k, top_p=top_p, seeds=seed, counters=jnp.zeros((1,), jnp.int32))
            full = jax.lax.all_gather(logits, AXIS, axis=0, tiled=True) if return_logits else jnp.zeros(())
            return tok[0], full, ks, vs

        mapped = jax.shard_map(
            shard_fn, mesh=self.mesh,
            in_specs=(self._pspecs, P(), P(), P(), P(), P(), P()),
            out_specs=(P(), P(), CACHE_SPEC, CACHE_SPEC), check_vma=False)
        return jax.jit(mapped)

    def _build_insert(self):
        def insert(state, ks, vs, slot, first, length, temp, top_k, top_p, seed):
            new = dict(state)
            new["k"] = [jax.lax.dynamic_update_slice(c, ks[i][None], (slot, 0, 0, 0)) for i, c in enumerate(state["k"])]
            new["v"] = [jax.lax.dynamic_update_slice(c, vs[i][None], (slot, 0, 0, 0)) for i, c in enumerate(state["v"])]
            for key, value in (("tokens", first), ("positions", length), ("counters", 1), ("temperature", temp),
                               ("top_k", top_k), ("top_p", top_p), ("seeds", seed)):
                new[key] = state[key].at[slot].set(value)
            return new

        return jax.jit(insert, donate_argnums=(0,), out_shardings=self._state_shardings)

    # ---- the API ---------------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], sampling: SamplingParams | None = None,
                return_logits: bool = False) -> Prefix:
        """Run a prompt (no slot needed yet) and sample its first output token."""
        sampling = sampling or SamplingParams()
        padded = self.padded_prompt(tokens, sampling)
        n, bucket = len(tokens), len(padded)
        fn = self._prefill_fn(bucket, sampling.greedy, return_logits)
        tok, logits, ks, vs = fn(self.params, padded, np.int32(n), *sampling_arrays([sampling]))
        return Prefix(first_token=int(tok), length=n, bucket=bucket, sampling=sampling, k=ks, v=vs,
                      logits=logits if return_logits else None)

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Place a prefilled prompt into a free slot; it joins the batch at the next ``generate``."""
        self.check_free(slot)
        s = prefix.sampling
        self._state = self._insert_fn(prefix.bucket)(
            self._state, prefix.k, prefix.v, np.int32(slot), np.int32(prefix.first_token), np.int32(prefix.length),
            np.float32(s.temperature), np.int32(s.top_k), np.float32(s.top_p), np.int32(s.seed))
        self.mark_inserted(prefix, slot)

    def dispatch(self, return_logits: bool = False) -> PendingStep:
        """Launch one decode step for the active slots and return without waiting for it.

        Serving overlaps the host's work on step n (streaming, stop checks) with the device running
        step n+1: dispatch the next step, then :meth:`collect` the previous one.
        """
        occupied = np.flatnonzero(self.active)
        if occupied.size == 0:
            raise RuntimeError("dispatch() with no active slot")
        batch = next(b for b in self.batch_buckets if b > occupied[-1])
        fn = self._step_fn(batch, self.greedy_only(), return_logits)
        self._state, tok, logits = fn(self.params, self._state)
        tok.copy_to_host_async()
        self.positions[occupied] += 1
        self.step_count += 1
        return PendingStep(step=self.step_count, batch=batch, tokens=tok, active=self.active[:batch].copy(),
                           generations=self.generation[:batch].copy(), logits=logits if return_logits else None)

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a dispatched step's tokens."""
        return StepResult(step=pending.step, batch=pending.batch, tokens=np.asarray(pending.tokens),
                          active=pending.active, generations=pending.generations, logits=pending.logits)

    def generate(self, return_logits: bool = False) -> StepResult:
        """One decode step, waited for: one new token for every active slot."""
        return self.collect(self.dispatch(return_logits))

    def warmup(self) -> float:
        """Run every step this engine will use once, so serving never compiles. Returns seconds."""

        def steps(greedy: bool) -> None:
            for batch in self.batch_buckets:
                self._state, _, _ = self._step_fn(batch, greedy, False)(self.params, self._state)
            jax.block_until_ready(self._state)

        return warm_up(self, self, steps)


def warm_up(engine: DecodeEngine, book: SlotBook, steps: Callable[[bool], None]) -> float:
    """Compile every program an engine serves with, by running each once: every prefill bucket
    (greedy and sampled), an insert per bucket, then ``steps(greedy)`` for the decode programs.

    Runs them for real (not ahead-of-time lowering) so that the dispatch caches are warm; with no
    active slot they only touch free slots' state, which the next insert overwrites. The calls go to
    ``engine`` (a pipeline leader passes itself, so every call is announced); ``book`` is the slot
    book that engine keeps.
    """
    if book.active.any():
        raise RuntimeError("warm up before inserting requests")
    t0 = time.perf_counter()
    for greedy in (True, False):
        sampling = SamplingParams() if greedy else SamplingParams(temperature=1.0)
        for bucket in book.prefill_buckets:
            prefix = engine.prefill([0] * min(bucket, engine.max_seq_len - 1), sampling)
            if greedy:
                engine.insert(prefix, 0)
                engine.evict(0)
        steps(greedy)
    book.positions[:] = 0
    return time.perf_counter() - t0


def slot_state(mesh: Mesh, slots: int) -> dict[str, jax.Array]:
    """Each slot's decode state, replicated over ``mesh``: its last token, the position it goes to,
    its sampling counter and its sampling parameters."""
    rep = NamedSharding(mesh, P())

    def small(value: np.ndarray) -> jax.Array:
        return jax.device_put(value, rep)

    return {
        "tokens": small(np.zeros(slots, np.int32)), "positions": small(np.zeros(slots, np.int32)),
        "counters": small(np.zeros(slots, np.int32)), "temperature": small(np.zeros(slots, np.float32)),
        "top_k": small(np.zeros(slots, np.int32)), "top_p": small(np.ones(slots, np.float32)),
        "seeds": small(np.zeros(slots, np.int32)),
    }


def sampling_arrays(params: Sequence[SamplingParams]) -> tuple[np.ndarray, ...]:
    return (np.array([p.temperature for p in params], np.float32), np.array([p.top_k for p in params], np.int32),
            np.array([p.top_p for p in params], np.float32), np.array([p.seed for p in params], np.int32))


def new_cache(shape: tuple[int, ...], sharding: NamedSharding, dtype: str,
              layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per-layer K and V caches of zeros, made on the devices."""
    zeros = jax.jit(lambda: jnp.zeros(shape, jnp.dtype(NP_DTYPES[dtype])), out_shardings=sharding)
    return [zeros() for _ in range(layers)], [zeros() for _ in range(layers)]


def random_weights(spec: ModelSpec, tp: int, dtype: str, seed: int,
                   devices: Sequence[jax.Device] | None = None) -> tuple[dict, Mesh]:
    """Random weights for a tensor-parallel group of ``tp`` devices, and its mesh."""
    mesh = make_mesh(tp, devices)
    return random_params(param_shapes(ShardShape(spec, tp)), param_specs(spec), mesh, dtype, seed), mesh


def random_params(shapes: Any, specs: Any, mesh: Mesh, dtype: str, seed: int) -> Any:
    """A parameter tree of random tensors (scaled like a trained model's), each made on the devices
    already sharded, so no host or single device ever holds a whole tensor."""
    jdtype = jnp.dtype(NP_DTYPES[dtype])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    arrays, inits = [], {}
    for n, ((path, shp), ps) in enumerate(zip(leaves, spec_leaves, strict=True)):
        is_norm = str(getattr(path[-1], "key", "")).endswith("norm")
        if (shp, ps, is_norm) not in inits:  # one compile per distinct shape, not per layer
            inits[shp, ps, is_norm] = jax.jit(
                functools.partial(_random_tensor, shape=shp, dtype=jdtype, is_norm=is_norm),
                out_shardings=NamedSharding(mesh, ps))
        arrays.append(inits[shp, ps, is_norm](jax.random.fold_in(jax.random.PRNGKey(seed), n)))
    return jax.tree.unflatten(treedef, arrays)


def _random_tensor(key: jax.Array, *, shape: tuple[int, ...], dtype: Any, is_norm: bool) -> jax.Array:
    if is_norm:
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)

