"""Pipeline-parallel decoding: layers split into stages over a (pp, tp) device mesh.

One SPMD program runs on every stage: stage s holds layers [s * L/pp, (s+1) * L/pp) (tensor-parallel
over its tp devices) and the KV cache of those layers. Decode runs as a circular pipeline: the slots
form ``pp`` micro-batches, and at each tick stage s works on micro-batch (tick - s) mod pp, then hands
its residual stream to stage s+1 (a device-to-device collective permute). The last stage's output is
shared with every stage, which computes its slice of the vocabulary (the LM head is split over all
devices) and samples; the micro-batch's new tokens re-enter stage 0 at the next tick. Every stage is
busy at every tick, each reading only its own layers' weights, so throughput scales with the stage
count while one sequence gets a token every ``pp`` ticks.

Each stage keeps the KV cache of every micro-batch in its own arrays, stored rotated by the stage
index: stage s keeps micro-batch g in array (g + s) mod pp. At tick t every stage then works on its
array t mod pp, the same on every stage, so each of the pp tick programs reads and writes whole
arrays known when it is compiled: no gather of a micro-batch's rows, no copy of a cache.

A request inserted into a slot whose micro-batch is in flight must not receive the stale work: each
slot has an insert count (``epoch``) that travels with its row through the pipeline; rows whose
epoch changed on the way neither write KV nor emit tokens.

The class implements the engine contract (:class:`~switchyard.service.engine.contract.DecodeEngine`), as
:class:`~switchyard.service.engine.tensor_parallel.Engine` does, so the scheduler drives either
unchanged. In a multi-process group every process runs the same calls in the same order
(:mod:`switchyard.service.engine.pipeline_group`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard.kernels import rmsnorm
from switchyard.service.engine.checkpoint import NP_DTYPES, load_params
from switchyard.service.engine.contract import PendingStep, Prefix, StepResult
from switchyard.service.engine.model import (
    AXIS,
    ForwardConfig,
    ShardShape,
    decode_attention,
    param_shapes,
    param_specs,
    prefill_layers,
    run_layers,
    stage_stacked,
)
from switchyard.service.engine.sampling import SamplingParams, sample_sharded
from switchyard.service.engine.tensor_parallel import (
    CACHE_ALIGN,
    SlotBook,
    new_cache,
    random_params,
    sampling_arrays,
    slot_state,
    warm_up,
)
from switchyard.service.modelspec import ModelSpec, ServingLayout

PP = "pp"
VOCAB_AXES = (PP, AXIS)
CACHE_SPEC = P(PP, None, AXIS, None, None)  # [stages, slots, kv_heads, max_seq, head_dim]


def make_pipeline_mesh(pp: int, tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if pp * tp > len(devices):
        raise ValueError(f"pp={pp} x tp={tp} needs {pp * tp} devices; {len(devices)} are visible")
    # Stage s takes devices [s*tp, (s+1)*tp): with one process per stage these are that process's own.
    return Mesh(np.array(devices[: pp * tp]).reshape(pp, tp), (PP, AXIS))


class PipelineEngine(SlotBook):
    """Pipeline-parallel decoding (see the module docstring); implements
    :class:`~switchyard.service.engine.contract.DecodeEngine`.

    The seam for benchmark variants (``benchmarks/variants.py``), as on
    :class:`~switchyard.service.engine.tensor_parallel.Engine`: the constructor calls
    ``_forward_config()`` and ``_new_cache(shape, sharding, layers)`` once each, and a variant may
    replace per-slot entries of the device state ``_state`` with the slot book's host mirror.
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
        super().__init__(spec, batch_slots, max_seq_len)
        self.params = params
        self.mesh = mesh
        self.pp, self.tp = mesh.shape[PP], mesh.shape[AXIS]
        if batch_slots % self.pp:
            raise ValueError(f"batch_slots ({batch_slots}) must be a multiple of the {self.pp} pipeline stages")
        if spec.num_layers % self.pp:
            raise ValueError(f"{self.pp} pipeline stages must divide the {spec.num_layers} layers")
        self.group = batch_slots // self.pp
        self.strategy = strategy
        self.dtype = dtype or spec.dtype
        self.shape = ShardShape(spec, self.tp, vocab_shards=self.pp * self.tp)
        self._cfg = self._forward_config()
        self._state = self._new_state()
        self.tick = 0
        self._entry: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # group -> (active, generation) at entry

    @classmethod
    def from_checkpoint(
        cls, path: str | Path, layout: ServingLayout, dtype: str | None = None,
        devices: Sequence[jax.Device] | None = None, progress: bool = True,
    ) -> PipelineEngine:
        spec = ModelSpec.from_file(path)
        dtype = dtype or spec.dtype
        mesh = make_pipeline_mesh(layout.pp, layout.tp, devices)
        ShardShape(spec, layout.tp)
        params = load_params(path, spec, mesh, dtype, progress=progress, stages=layout.pp)
        return cls(spec, params, mesh, batch_slots=layout.batch_slots, max_seq_len=layout.max_seq_len,
                   strategy=layout.strategy, dtype=dtype)

    @classmethod
    def from_random(
        cls, spec: ModelSpec, layout: ServingLayout, dtype: str = "bfloat16", seed: int = 0,
        devices: Sequence[jax.Device] | None = None,
    ) -> PipelineEngine:
        """Random weights made on the devices, each stage's layers on its own (benchmarks)."""
        params, mesh = random_stage_weights(spec, layout, dtype, seed, devices)
        return cls(spec, params, mesh, batch_slots=layout.batch_slots, max_seq_len=layout.max_seq_len,
                   strategy=layout.strategy, dtype=dtype)

    # ---- the seam for benchmark variants (see the class docstring) ----------------------------------
    def _forward_config(self) -> ForwardConfig:
        return ForwardConfig.make(self.shape, self.strategy)

    def _new_cache(self, shape: tuple[int, ...], sharding: NamedSharding,
                   layers: int) -> tuple[list[jax.Array], list[jax.Array]]:
        return new_cache(shape, sharding, self.dtype, layers)

    # ---- state ------------------------------------------------------------------------------------
    def _new_state(self) -> dict[str, Any]:
        s, pp, m = self.spec, self.pp, self.group
        per_stage = s.num_layers // pp
        cache_len = -(-self.max_seq_len // CACHE_ALIGN) * CACHE_ALIGN
        # k[j][r]: layer j of this stage, local micro-batch array r (see the module docstring).
        k, v = self._new_cache((pp, m, s.num_kv_heads, cache_len, s.head_dim), NamedSharding(self.mesh, CACHE_SPEC),
                               per_stage * pp)
        return {
            "k": [k[j * pp : (j + 1) * pp] for j in range(per_stage)],
            "v": [v[j * pp : (j + 1) * pp] for j in range(per_stage)],
            "act": jax.device_put(np.zeros((pp, m, s.hidden_size), NP_DTYPES[self.dtype]),
                                  NamedSharding(self.mesh, P(PP))),
            "act_epoch": jax.device_put(np.zeros((pp, m), np.int32), NamedSharding(self.mesh, P(PP))),
            **slot_state(self.mesh, self.max_slots),
            "epoch": jax.device_put(np.zeros(self.max_slots, np.int32), NamedSharding(self.mesh, P())),
        }

    def _state_shardings(self) -> dict[str, Any]:
        return jax.tree.map(lambda a: a.sharding, self._state)

    def _state_specs(self) -> dict[str, Any]:
        return jax.tree.map(lambda a: a.sharding.spec, self._state)

    def _param_specs(self) -> Any:
        def layer_spec(a: jax.Array) -> P:
            return a.sharding.spec
        return jax.tree.map(layer_spec, self.params)

    # ---- compiled programs ----------------------------------------------------------------------
    def _build_tick(self, greedy_only: bool, local: int):
        """The tick program for ticks t with t mod pp == ``local``: every stage's micro-batch array."""
        cfg, vocab, pp, m = self._cfg, self.spec.vocab_size, self.pp, self.group
        eps, last_pos = self.spec.rms_norm_eps, self.max_seq_len - 1
        state_specs = self._state_specs()

        def shard_fn(params, state, t):
            stage = jax.lax.axis_index(PP)
            layers = [jax.tree.map(lambda a: a[0], layer) for layer in params["layers"]]
            g_in = (t - stage) % pp
            rows = g_in * m + jnp.arange(m)
            fresh = params["embed"][state["tokens"][rows]]
            x = jnp.where(stage == 0, fresh, state["act"][0])
            entry_epoch = jnp.where(stage == 0, state["epoch"][rows], state["act_epoch"][0])
            write = entry_epoch == state["epoch"][rows]
            pos = state["positions"][rows]
            new_k, new_v = [list(c) for c in state["k"]], [list(c) for c in state["v"]]

            def attention(j: int, h: jax.Array) -> jax.Array:
                out, kc, vc = decode_attention(layers[j], h, state["k"][j][local][0], state["v"][j][local][0],
                                               pos, cfg, write=write)
                new_k[j][local], new_v[j][local] = kc[None], vc[None]
                return out

            residual, _ = run_layers(x, layers, cfg, attention, final_norm=None)
            hop = [(i, i + 1) for i in range(pp - 1)]
            handed = jax.lax.ppermute(residual, PP, hop) if hop else residual
            handed_epoch = jax.lax.ppermute(entry_epoch, PP, hop) if hop else entry_epoch
            is_last = stage == pp - 1
            out_residual = jax.lax.psum(jnp.where(is_last, residual, jnp.zeros_like(residual)), PP)
            out_epoch = jax.lax.psum(jnp.where(is_last, entry_epoch, 0), PP)
            g_out = (t - (pp - 1)) % pp
            rows_out = g_out * m + jnp.arange(m)
            h = rmsnorm(out_residual, params["final_norm"], eps)
            logits = jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)
            tok = sample_sharded(logits, vocab, VOCAB_AXES, greedy_only=greedy_only,
                                 temperature=state["temperature"][rows_out], top_k=state["top_k"][rows_out],
                                 top_p=state["top_p"][rows_out], seeds=state["seeds"][rows_out],
                                 counters=state["counters"][rows_out])
            valid = (out_epoch == state["epoch"][rows_out]) & (t >= pp - 1)
            new = dict(state, k=new_k, v=new_v, act=handed[None], act_epoch=handed_epoch[None])
            new["tokens"] = state["tokens"].at[rows_out].set(jnp.where(valid, tok, state["tokens"][rows_out]))
            old_pos = state["positions"][rows_out]
            new["positions"] = state["positions"].at[rows_out].set(
                jnp.where(valid, jnp.minimum(old_pos + 1, last_pos), old_pos))
            new["counters"] = state["counters"].at[rows_out].add(valid.astype(jnp.int32))
            # The token vector also leaves as its own output: the state is donated to the next tick.
            return new, new["tokens"] + 0

        mapped = jax.shard_map(shard_fn, mesh=self.mesh, in_specs=(self._param_specs(), state_specs, P()),
                               out_specs=(state_specs, P()), check_vma=False)
        return jax.jit(mapped, donate_argnums=(1,), out_shardings=(self._state_shardings(), None))

    def _build_prefill(self, greedy_only: bool, return_logits: bool):
        cfg, vocab, pp = self._cfg, self.spec.vocab_size, self.pp
        eps = self.spec.rms_norm_eps

        def shard_fn(params, tokens, length, temp, top_k, top_p, seed):
            stage = jax.lax.axis_index(PP)
            layers = [jax.tree.map(lambda a: a[0], layer) for layer in params["layers"]]
            x = params["embed"][tokens]
            ks = vs = None
            for i in range(pp):  # stage i runs while the others wait (prefill is compute-bound)
                def run(x):
                    residual, _, k, v = prefill_layers(x, layers, length, cfg, None)
                    return residual, k, v

                shapes = jax.eval_shape(run, x)

                def skip(x, shapes=shapes):
                    return x, jnp.zeros(shapes[1].shape, shapes[1].dtype), jnp.zeros(shapes[2].shape, shapes[2].dtype)

                residual, k, v = jax.lax.cond(stage == i, run, skip, x)
                ks = k if ks is None else jnp.where(stage == i, k, ks)
                vs = v if vs is None else jnp.where(stage == i, v, vs)
                x = jax.lax.psum(jnp.where(stage == i, residual, jnp.zeros_like(residual)), PP)
            h = rmsnorm(x, params["final_norm"], eps)
            last = jax.lax.dynamic_index_in_dim(h, length - 1, axis=0, keepdims=False)
            logits = jnp.dot(last, params["lm_head"], preferred_element_type=jnp.float32)
            tok = sample_sharded(logits[None], vocab, VOCAB_AXES, greedy_only=greedy_only, temperature=temp,
                                 top_k=top_k, top_p=top_p, seeds=seed, counters=jnp.zeros((1,), jnp.int32))
            full = jax.lax.all_gather(logits, VOCAB_AXES, axis=0, tiled=True) if return_logits else jnp.zeros(())
            return tok[0], full, ks[None], vs[None]

        kv_spec = P(PP, None, AXIS, None, None)  # [stages, layers_per_stage, kv_heads, T, head_dim]
        mapped = jax.shard_map(shard_fn, mesh=self.mesh, in_specs=(self._param_specs(), P(), P(), P(), P(), P(), P()),
                               out_specs=(P(), P(), kv_spec, kv_spec), check_vma=False)
        return jax.jit(mapped)

    def _build_insert(self):
        pp, m = self.pp, self.group
        state_specs = self._state_specs()
        kv_spec = P(PP, None, AXIS, None, None)  # prefill's [stages, layers_per_stage, kv_heads, T, head_dim]

        def shard_fn(state, ks, vs, slot, first, length, temp, top_k, top_p, seed):
            stage = jax.lax.axis_index(PP)
            g, row = slot // m, slot % m
            target = (g + stage) % pp  # this stage's array for the slot's micro-batch

            def put(arrays: list[jax.Array], new: jax.Array) -> list[jax.Array]:
                out = []
                for r, c in enumerate(arrays):
                    start = (0, row, 0, 0, 0)
                    old = jax.lax.dynamic_slice(c, start, (1, 1, *new.shape))
                    # Only the window is chosen, never the array, so the update stays in place.
                    out.append(jax.lax.dynamic_update_slice(c, jnp.where(r == target, new[None, None], old), start))
                return out

            new = dict(state)
            new["k"] = [put(arrays, ks[0, j]) for j, arrays in enumerate(state["k"])]
            new["v"] = [put(arrays, vs[0, j]) for j, arrays in enumerate(state["v"])]
            for key, value in (("tokens", first), ("positions", length), ("counters", 1), ("temperature", temp),
                               ("top_k", top_k), ("top_p", top_p), ("seeds", seed)):
                new[key] = state[key].at[slot].set(value)
            new["epoch"] = state["epoch"].at[slot].add(1)
            return new

        scalars = (P(),) * 7  # slot, first, length, temperature, top_k, top_p, seed
        mapped = jax.shard_map(shard_fn, mesh=self.mesh, in_specs=(state_specs, kv_spec, kv_spec, *scalars),
                               out_specs=state_specs, check_vma=False)
        return jax.jit(mapped, donate_argnums=(0,), out_shardings=self._state_shardings())

    # ---- the API (as Engine) --------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], sampling: SamplingParams | None = None,
                return_logits: bool = False) -> Prefix:
        sampling = sampling or SamplingParams()
        return self.run_prefill(self.padded_prompt(tokens, sampling), len(tokens), sampling, return_logits)

    def run_prefill(self, padded: np.ndarray, n: int, sampling: SamplingParams, return_logits: bool) -> Prefix:
        """The SPMD part of :meth:`prefill` (every process of a group runs it with the same arguments)."""
        bucket = len(padded)
        fn = self._compiled(("prefill", bucket, sampling.greedy, return_logits),
                            lambda: self._build_prefill(sampling.greedy, return_logits))
        tok, logits, ks, vs = fn(self.params, padded, np.int32(n), *sampling_arrays([sampling]))
        return Prefix(first_token=int(tok), length=n, bucket=bucket, sampling=sampling, k=ks, v=vs,
                      logits=logits if return_logits else None)

    def insert(self, prefix: Prefix, slot: int) -> None:
        self.check_free(slot)
        self.run_insert(prefix, slot)
        self.mark_inserted(prefix, slot)

    def run_insert(self, prefix: Prefix, slot: int) -> None:
        """The SPMD part of :meth:`insert`."""
        s = prefix.sampling
        fn = self._compiled(("insert", prefix.bucket), self._build_insert)
        self._state = fn(self._state, prefix.k, prefix.v, np.int32(slot), np.int32(prefix.first_token),
                         np.int32(prefix.length), np.float32(s.temperature), np.int32(s.top_k),
                         np.float32(s.top_p), np.int32(s.seed))

    def dispatch(self, return_logits: bool = False) -> PendingStep:
        """Launch one pipeline tick: micro-batch ``tick mod pp`` enters, ``(tick - pp + 1) mod pp`` leaves
        with one new token per slot."""
        if return_logits:
            raise NotImplementedError("a pipeline tick does not return logits; use prefill logits to check")
        t, pp, m = self.tick, self.pp, self.group
        g_in, g_out = t % pp, (t - (pp - 1)) % pp
        rows_in = slice(g_in * m, (g_in + 1) * m)
        self._entry[g_in] = (self.active[rows_in].copy(), self.generation[rows_in].copy())
        tokens = self.run_tick(t, self.greedy_only())
        active = np.zeros(self.max_slots, dtype=bool)
        generations = self.generation.copy()
        rows_out = slice(g_out * m, (g_out + 1) * m)
        if t >= pp - 1 and g_out in self._entry:
            entry_active, entry_gen = self._entry[g_out]
            active[rows_out] = entry_active
            generations[rows_out] = entry_gen
            still = entry_active & (entry_gen == self.generation[rows_out])
            self.positions[rows_out] += still
        self.tick += 1
        self.step_count += 1
        return PendingStep(step=self.step_count, batch=self.max_slots, tokens=tokens, active=active,
                           generations=generations, logits=None)

    def run_tick(self, t: int, greedy_only: bool) -> jax.Array:
        """The SPMD part of :meth:`dispatch`; returns the token vector (still on the device)."""
        local = t % self.pp
        fn = self._compiled(("tick", greedy_only, local), lambda: self._build_tick(greedy_only, local))
        self._state, tokens = fn(self.params, self._state, np.int32(t))
        tokens.copy_to_host_async()
        return tokens

    def collect(self, pending: PendingStep) -> StepResult:
        return StepResult(step=pending.step, batch=pending.batch, tokens=np.asarray(pending.tokens),
                          active=pending.active, generations=pending.generations, logits=None)

    def generate(self, return_logits: bool = False) -> StepResult:
        return self.collect(self.dispatch(return_logits))

    def warmup(self) -> float:
        # With no slot active (and the epochs guarding every later insert) nothing is emitted.
        def ticks(greedy: bool) -> None:
            for t in range(self.pp):  # one program per local micro-batch array
                self.run_tick(t, greedy).block_until_ready()

        return warm_up(self, self, ticks)


def random_stage_weights(spec: ModelSpec, layout: ServingLayout, dtype: str, seed: int,
                         devices: Sequence[jax.Device] | None = None) -> tuple[dict, Mesh]:
    """Random weights for a pipeline of ``layout.pp`` stages of ``layout.tp`` devices, each stage's
    layers made on its own devices, and the pipeline's mesh."""
    mesh = make_pipeline_mesh(layout.pp, layout.tp, devices)
    pp = layout.pp
    if spec.num_layers % pp:
        raise ValueError(f"{pp} pipeline stages must divide the {spec.num_layers} layers")
    shapes = param_shapes(ShardShape(spec, layout.tp, vocab_shards=pp * layout.tp))
    specs = param_specs(spec)
    per_stage = spec.num_layers // pp
    stacked = [stage_stacked(shp, ps, pp, PP) for shp, ps in zip(shapes["layers"], specs["layers"], strict=True)]
    shapes["layers"] = [shp for shp, _ in stacked[:per_stage]]
    specs["layers"] = [ps for _, ps in stacked[:per_stage]]
    specs["lm_head"] = P(None, VOCAB_AXES)
    return random_params(shapes, specs, mesh, dtype, seed), mesh
