"""The engine: a model's weights and paged KV pool on a device mesh, and the compiled steps that run
the scheduler's plans over them. It keeps no books: the scheduler's KV manager decides which blocks
each sequence holds and the step policy which program each step runs (``plan.py`` is the contract).

Every step is ONE forward pass (``model.budget_forward``): a token for each decode row plus the
prompt chunks the plan carries (none, one, or several of different prompts); the step that carries a
prompt's last chunk samples its first token, and the slot decodes from then on. Per-slot decode
state (last token, position, sampling parameters and counter) lives on the devices and is donated to
each step, so a decode row needs no input from the host.

A step's changing inputs (decode rows, block tables, the chunks) and its tokens live in donated device
buffers of their own too (``_io``): small programs copy the host's new values in before a step and
the step's tokens out after it. A step program then sees the same addresses at every launch, so XLA
replays its command buffer as recorded; a new address anywhere makes it update the buffer's hundreds
of commands first, which took 2-6 ms of host time on H200 (benchmarks/NOTES.md). XLA's own temporary
buffer keeps its address under the allocator and update mode of ``xla_runtime``.

With ``pp`` > 1 the mesh has a pipeline axis: each stage holds its share of the layers and of the KV
pool, and a step runs the stages one after another, handing the residual stream on device to device
(``pipeline.py``); the tokens are those of one device. Stage 0's process plans; in a group of
processes it sends each plan to the others (``pipeline_group.py``), which launch it too.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, as_completed, wait
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels import kv_cache
from switchyard.kernels.collectives import MAX_PARTIALS
from switchyard.kernels.selection import check_strategy
from switchyard.kernels.weights import with_w8a8_min_rows
from switchyard.service.engine import param_formats
from switchyard.service.engine.checkpoint import NP_DTYPES, load_params
from switchyard.service.engine.compile_cache import (
    ProgramStore,
    WarmUp,
    describe_arguments,
    environment_facts,
    file_digest,
    program_key,
    source_digest,
    stable_repr,
)
from switchyard.service.engine.fp8_checkpoint import CHOICES as QUANTIZATION_CHOICES
from switchyard.service.engine.host import usable_cpus
from switchyard.service.engine.kv_blocks import NULL_BLOCK
from switchyard.service.engine.model import AXIS, Chunk, ForwardConfig, ShardShape, budget_forward, param_specs
from switchyard.service.engine.pipeline import (
    PP,
    STAGE_POOL_SPEC,
    VOCAB_AXES,
    make_pipeline_mesh,
    pipeline_forward,
    stage_param_specs,
)
from switchyard.service.engine.plan import ChunkPlan, StepPlan, StepTokens
from switchyard.service.engine.sampling import SamplingParams, sample_sharded
from switchyard.service.engine.step_policy import MIN_BATCH_WIDTH, StepPolicy, StepShape, products_first
from switchyard.service.engine.xla_notices import autotuner_notices_counted
from switchyard.service.engine.xla_runtime import (
    ALLOCATOR_ENV,
    MEMORY_FRACTION_ENVS,
    compiler_room,
    free_device_memory,
    memory_fraction,
    step_compiler_options,
)
from switchyard.service.model.quantization import QUANTIZED_AT_LOAD
from switchyard.service.modelspec import (
    DEFAULT_KV_MEMORY_FRACTION,
    DEFAULT_STEP_TOKENS,
    IDLE_STEP_TOKENS,
    KV_BLOCK_TOKENS,
    KV_CACHE_DTYPES,
    ModelSpec,
    ModelSpecError,
    ServingLayout,
    kv_tokens_for_memory,
)

# What a compile-cache key leaves out of the model and configuration: names, which shape no program.
UNNAMED = frozenset({"name"})
POOL_SPEC = P(None, AXIS, None, None)  # [blocks, kv_heads, block_size, head_dim], sharded by KV head
ATTENTIONS = ("auto", "xla")
# FP8 weights: products whose activation has at least this many rows run FP8 x FP8 (W8A8: the
# activation quantized per token, cuBLASLt's FP8 GEMM on Hopper); fewer rows convert the weight
# inside the product (W8A16). Decode steps read every weight once for few rows, so they are bound by
# the weights' bytes, which both halve; a prompt chunk's step is bound by arithmetic, which W8A8
# doubles on Hopper. Provisional: the crossover is the H100's ridge point for a byte-per-weight
# product (about 990 TFLOP/s over 3.35 TB/s, ~150 rows for 2 FLOP per weight and row), not yet a
# measurement of the two products (benchmarks/fp8.py reports the measured crossover).
DEFAULT_W8A8_MIN_ROWS = 128
# Compiles at warm-up hold host memory each, so the pool stays small even on a large host.
MAX_COMPILE_WORKERS = 8


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an engine serves: its sizes, its collectives and its kernels.

    ``kv_tokens`` 0 sizes the KV pool at start-up as ``kv_memory_fraction`` of the memory left after
    the weights. ``decode_attention``: ``auto`` runs our decode-attention kernel where it can run
    (XLA's ops elsewhere), ``xla`` always XLA's ops. ``row_parallel_splits``: the partial products a
    row-parallel product hands the fused all-reduce (see ``kernels.collectives``). ``min_batch_width``:
    the narrowest decode width compiled.

    Formats: ``quantization`` ``auto`` serves the checkpoint's layer matrices as they are (FP8
    checkpoints in FP8, 16-bit ones in ``dtype``), ``fp8`` quantizes 16-bit ones at load (a scale per
    output channel), ``none`` dequantizes FP8 ones; ``w8a8_min_rows`` is the FP8 products' policy
    (:data:`DEFAULT_W8A8_MIN_ROWS`; 0: weight-only FP8 in every product); ``kv_cache_dtype``
    ``fp8`` holds the KV pool in e4m3 with a scale per position and KV head (``kernels.kv_cache``:
    1.94 times the tokens at head_dim 128), ``auto`` in ``dtype``.
    """

    batch_slots: int = 8
    max_seq_len: int = 2048
    strategy: str = "auto"
    dtype: str | None = None  # default: the checkpoint's
    kv_tokens: int = 0
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    step_tokens: int = DEFAULT_STEP_TOKENS
    idle_step_tokens: int = IDLE_STEP_TOKENS
    block_size: int = KV_BLOCK_TOKENS
    min_batch_width: int = MIN_BATCH_WIDTH
    decode_attention: str = "auto"
    row_parallel_splits: int = kernels.K_SPLITS
    quantization: str = "auto"
    w8a8_min_rows: int = DEFAULT_W8A8_MIN_ROWS
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_strategy(self.strategy)
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {QUANTIZATION_CHOICES}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.w8a8_min_rows < 0:
            raise ValueError(f"w8a8_min_rows must be 0 (never) or more, got {self.w8a8_min_rows}")
        if self.decode_attention not in ATTENTIONS:
            raise ValueError(f"decode_attention must be one of {ATTENTIONS}, got {self.decode_attention!r}")
        if not 1 <= self.row_parallel_splits <= MAX_PARTIALS:
            raise ValueError(f"row_parallel_splits must be 1..{MAX_PARTIALS}, got {self.row_parallel_splits}")
        for name in ("batch_slots", "max_seq_len", "step_tokens", "block_size", "min_batch_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_layout(cls, layout: ServingLayout, **changes: Any) -> EngineConfig:
        """The layout file's sizes (what ``switchyard serve`` and the operator set), with ``changes``."""
        return cls(**{"batch_slots": layout.batch_slots, "max_seq_len": layout.max_seq_len,
                      "strategy": layout.strategy, "kv_tokens": layout.kv_tokens,
                      "kv_memory_fraction": layout.kv_memory_fraction, "step_tokens": layout.step_tokens,
                      "quantization": layout.quantization, "kv_cache_dtype": layout.kv_cache_dtype,
                      **changes})

    def step_policy(self) -> StepPolicy:
        """The step policy these sizes make (the scheduler plans with it; the engine compiles its shapes)."""
        return StepPolicy(max_slots=self.batch_slots, max_seq_len=self.max_seq_len, block_size=self.block_size,
                          step_tokens=self.step_tokens, idle_step_tokens=self.idle_step_tokens,
                          min_width=self.min_batch_width)


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None, pp: int = 1) -> Mesh:
    """The devices of a tensor-parallel group (axis ``tp``), or of ``pp`` > 1 pipeline stages of such
    groups (axes ``pp``, ``tp``)."""
    if pp > 1:
        return make_pipeline_mesh(pp, tp, devices)
    devices = list(devices if devices is not None else jax.devices())
    if tp > len(devices):
        raise ValueError(f"tensor-parallel size {tp} needs {tp} devices; this process sees {len(devices)}")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def compile_workers() -> int:
    """Threads that compile step programs at warm-up: the CPUs this process may run on, at most
    :data:`MAX_COMPILE_WORKERS`."""
    return min(MAX_COMPILE_WORKERS, usable_cpus())


# A step's chunks travel as one int32 array (one host-to-device copy, not one per field), a row per
# chunk the policy may pack into a step: [tokens (padded to idle_step_tokens, the largest chunk size),
# the sequence's block table, slot, start, length, completes, temperature, top_k, top_p, seed,
# counter], temperature and top_p as float32 bits. A step's program reads the first rows, as many as
# its chunks, and of each the first tokens, as many as its chunk size.
_CHUNK_FIELDS = 9


def pack_chunk(chunk_tokens: int, table: np.ndarray, tokens: np.ndarray, slot: int, start: int, completes: bool,
               sampling: SamplingParams, counter: int) -> np.ndarray:
    m = table.shape[0]
    out = np.zeros(chunk_tokens + m + _CHUNK_FIELDS, np.int32)
    out[: len(tokens)] = tokens
    out[chunk_tokens: chunk_tokens + m] = table
    floats = np.array([sampling.temperature, sampling.top_p], np.float32).view(np.int32)
    out[chunk_tokens + m:] = (slot, start, len(tokens), completes, floats[0], sampling.top_k, floats[1], sampling.seed,
                              counter)
    return out


def _unpack_chunks(packed: jax.Array, table_len: int, chunk_tokens: int, chunks: int) -> tuple[jax.Array, ...]:
    """The first ``chunks`` rows of ``packed``: (tokens [K, chunk_tokens], tables [K, M], then [K] each:
    slot, start, length, completes, (temperature, top_k, top_p, seed, counter))."""
    packed = packed[:chunks]
    c = packed.shape[1] - table_len - _CHUNK_FIELDS
    f = c + table_len
    slot, start, length, completes, temp, top_k, top_p, seed, counter = (packed[:, f + i] for i in range(_CHUNK_FIELDS))
    as_float = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    return (packed[:, :chunk_tokens], packed[:, c:f], slot, start, length, completes != 0,
            (as_float(temp), top_k, as_float(top_p), seed, counter))


def _write_io(io: dict[str, jax.Array], updates: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``io`` with ``updates`` written over its entries in place (a donated ``io`` keeps its buffers)."""
    return {key: jax.lax.dynamic_update_slice(a, updates[key], (0,) * a.ndim) if key in updates else a
            for key, a in io.items()}


def _read_out(io: dict[str, jax.Array]) -> jax.Array:
    """A copy of a step's tokens, which outlives the next step's donation of ``io``."""
    return io["out"] + 0


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


def new_pool(shape: tuple[int, ...], mesh: Mesh, spec: P, dtype: str, layers: int,
             kv_cache_dtype: str = "auto") -> tuple[list[kv_cache.Pool], list[kv_cache.Pool]]:
    """Per-layer K and V pools of zeros (``kv_cache_dtype``: in ``dtype`` or FP8), made on the
    devices; ``spec`` shards the pool's data."""
    shardings = jax.tree.map(lambda ps: NamedSharding(mesh, ps), kv_cache.spec_of(spec, kv_cache_dtype))
    zeros = jax.jit(lambda: kv_cache.zeros(shape, kv_cache_dtype, jnp.dtype(NP_DTYPES[dtype])),
                    out_shardings=shardings)
    return [zeros() for _ in range(layers)], [zeros() for _ in range(layers)]


def pool_tokens(spec: ModelSpec, config: EngineConfig, tp: int, pp: int, dtype: str, free: int | None,
                room: int | None = None) -> int:
    """The KV pool's size in tokens: the config's, checked against ``free`` bytes per GPU, or what fits
    in its share of them and in ``room`` (``xla_runtime.compiler_room``: what XLA's compiler assumes
    is left, where the allocator does not tell it); with ``free`` None (host devices), every slot's
    whole context at most. A token's bytes are ``dtype``'s, or FP8's with its scales
    (``config.kv_cache_dtype``)."""
    dtype = "fp8" if config.kv_cache_dtype == "fp8" else dtype
    bs = config.block_size
    table_tokens = -(-config.max_seq_len // bs) * bs
    if config.kv_tokens:
        tokens = config.kv_tokens
        if free is not None:
            need = (tokens + bs) * spec.kv_bytes_per_token_per_gpu(tp, pp, dtype)  # and the null block
            if need > free:
                gib = 2**30
                raise ModelSpecError(
                    f"layout.kv_tokens {tokens} needs {need / gib:.2f} GiB of KV cache per GPU, but only "
                    f"{free / gib:.2f} GiB is free after the weights; lower kv_tokens (0 sizes the pool from "
                    f"kv_memory_fraction)")
    elif free is None:
        tokens = config.batch_slots * table_tokens
    else:
        budget = int(free * config.kv_memory_fraction)
        if room is not None:
            budget = min(budget, room)
        tokens = kv_tokens_for_memory(spec, tp, pp, budget, dtype) // bs * bs
    if free is None:
        # Host devices: no device memory to fill, so no more than the sequences can use (a layout
        # planned for a GPU may ask for far more than the host has).
        tokens = min(tokens, config.batch_slots * table_tokens)
    if tokens % bs:
        raise ModelSpecError(f"kv_tokens {tokens} is not a whole number of {bs}-token blocks")
    if tokens < config.max_seq_len:
        raise ModelSpecError(f"the KV pool holds {tokens} tokens, fewer than one sequence of max_seq_len "
                             f"{config.max_seq_len}; lower max_seq_len or give the pool more memory")
    return tokens


@dataclasses.dataclass
class PendingStep:
    """A launched step whose tokens are still on the device: ``rows`` decode rows, ``chunks`` chunks."""

    step: int
    tokens: jax.Array
    rows: int
    chunks: int


class Engine:
    """One model on a tensor-parallel group (module docstring): launches the scheduler's plans."""

    def __init__(self, spec: ModelSpec, params: dict, mesh: Mesh, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.spec = spec
        self.params = params
        self.mesh = mesh
        self.config = config
        self.tp = mesh.shape[AXIS]
        self.pp = dict(mesh.shape).get(PP, 1)
        self.dtype = config.dtype or spec.dtype
        self.shape = ShardShape(spec, self.tp, vocab_shards=self.pp * self.tp)
        # FP8 weights carry the products' policy (static: it chooses the product when traced).
        self.params = params = with_w8a8_min_rows(params, config.w8a8_min_rows)
        formats = param_formats.formats_of(params["layers"]) * self.pp
        self.weight_formats = formats
        self.policy = config.step_policy()
        self.max_slots = config.batch_slots
        self.max_seq_len = config.max_seq_len
        self.kv_block_size = config.block_size
        self.step_tokens = config.step_tokens
        self.blocks_per_seq = self.policy.blocks_per_seq
        self._cfg = self._forward_config(mesh.devices.flat[0].platform)
        self._pspecs = with_w8a8_min_rows(
            param_specs(spec, formats) if self.pp == 1 else stage_param_specs(spec, self.pp, formats),
            config.w8a8_min_rows)
        self._vocab_axes = AXIS if self.pp == 1 else VOCAB_AXES
        if config.strategy != "xla" and self.tp > 1 and self.pp == 1:
            kernels.init(list(mesh.devices.flat))
        if mesh.devices.flat[0].platform == "gpu":
            # Loads the decode-attention kernels on the GPUs now: tracing a step would, but a step
            # program loaded from the compile cache is never traced.
            kernels.attention_ready()
        self.kv_tokens = self._pool_tokens()
        self.num_blocks = self.kv_tokens // self.kv_block_size + 1  # and the null block
        self._state = self._new_state()
        self._io = self._new_io()
        self._programs: dict[tuple, Any] = {}
        self.step_count = 0

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path: str | Path, layout: ServingLayout, config: EngineConfig | None = None,
                        devices: Sequence[jax.Device] | None = None, progress: bool = True) -> Engine:
        """The checkpoint's weights on a mesh of ``layout.pp`` stages of ``layout.tp`` devices, served
        as ``config`` says (by default: as the layout says, in the checkpoint's dtype)."""
        spec = ModelSpec.from_file(path)
        config = config or EngineConfig.from_layout(layout)
        ShardShape(spec, layout.tp)
        mesh = make_mesh(layout.tp, devices, layout.pp)
        params = load_params(path, spec, mesh, config.dtype or spec.dtype, progress=progress, stages=layout.pp,
                             quantization=config.quantization)
        return cls(spec, params, mesh, config)

    @classmethod
    def from_random(cls, spec: ModelSpec, layout: ServingLayout, config: EngineConfig | None = None, seed: int = 0,
                    devices: Sequence[jax.Device] | None = None) -> Engine:
        """Random weights of ``spec``'s shape, made on the devices (benchmarks and tests); with
        ``config.quantization`` ``fp8``, in FP8 with a scale per output channel."""
        from switchyard.service.engine.random_weights import random_weights

        config = config or EngineConfig.from_layout(layout, dtype="bfloat16")
        mesh = make_mesh(layout.tp, devices, layout.pp)
        params = random_weights(spec, mesh, config.dtype or spec.dtype, seed, quantization=config.quantization)
        return cls(spec, params, mesh, config)

    def _forward_config(self, platform: str) -> ForwardConfig:
        cfg = ForwardConfig.make(self.shape, self.config.strategy, platform=platform)
        changes: dict[str, Any] = {}
        if self.config.decode_attention == "xla":
            changes["paged_decode_attention"] = functools.partial(
                kernels.attention.paged_decode_attention_packed, use_kernel=False)
        if self.config.row_parallel_splits != kernels.K_SPLITS:
            changes["row_parallel_norm"] = functools.partial(kernels.row_parallel_residual_rmsnorm,
                                                             k_splits=self.config.row_parallel_splits)
        return dataclasses.replace(cfg, **changes)

    def _pool_tokens(self) -> int:
        devices = list(self.mesh.devices.flat)
        held = collections.Counter()
        for leaf in jax.tree_util.tree_leaves(self.params):
            for shard in leaf.addressable_shards:
                held[shard.device] += shard.data.nbytes
        weights = max(held.values(), default=0)  # the GPU holding the most
        free = free_device_memory(devices, kernels.device_memory, memory_fraction(), weights)
        room = compiler_room(devices, kernels.device_memory, weights)
        return pool_tokens(self.spec, self.config, self.tp, self.pp, self.dtype, free, room)

    @property
    def _pool_data_spec(self) -> P:
        return POOL_SPEC if self.pp == 1 else STAGE_POOL_SPEC

    @property
    def _pool_spec(self) -> Any:
        """A layer pool's partition specs (an FP8 pool's data and scales)."""
        return kv_cache.spec_of(self._pool_data_spec, self.config.kv_cache_dtype)

    @property
    def weights_label(self) -> str:
        """The layer matrices' format for people (the start-up log, ModelInfo, traces): ``bfloat16``,
        or FP8 with its format and the products' policy."""
        fp8 = param_formats.fp8_matrices(self.weight_formats)
        if not fp8:
            return self.dtype
        source = (self.spec.quantization or QUANTIZED_AT_LOAD).label
        rows = self.config.w8a8_min_rows
        products = (f"FP8 x FP8 from {rows} rows, weight-only below" if rows else "weight-only products")
        total = 4 * len(self.weight_formats)
        held = "" if fp8 == total else f", {fp8} of {total} matrices"
        return f"{source}{held}; {products}; activations {self.dtype}"

    @property
    def kv_cache_label(self) -> str:
        """The KV pool's format for people: the model's dtype, or FP8 with its scales."""
        return kv_cache.label(self.config.kv_cache_dtype, self.dtype)

    def _new_state(self) -> dict[str, Any]:
        s, pp = self.spec, self.pp
        shape = (self.num_blocks, s.num_kv_heads, self.kv_block_size, s.head_dim)
        k, v = new_pool(shape if pp == 1 else (pp, *shape), self.mesh, self._pool_data_spec, self.dtype,
                        s.num_layers // pp, self.config.kv_cache_dtype)
        return {"k": k, "v": v, **slot_state(self.mesh, self.max_slots)}

    def _new_io(self) -> dict[str, jax.Array]:
        """A step's inputs and tokens, replicated: ``rows`` [max_slots] (the decoding slots, then
        max_slots), their block ``tables`` [max_slots, M], the ``chunks`` (packed, a row each) and
        ``out`` [max_slots + chunks] (a token per row, then the chunks')."""
        rep = NamedSharding(self.mesh, P())
        host = {**self._row_arrays(np.zeros(0, np.int64), None), "chunks": self._pack(()),
                "out": np.zeros(self.max_slots + self.policy.packed_chunks, np.int32)}
        return {key: jax.device_put(value, rep) for key, value in host.items()}

    def _row_arrays(self, rows: np.ndarray, tables: np.ndarray | None) -> dict[str, np.ndarray]:
        """``rows`` and ``tables`` of ``_io``: the decoding slots (ascending), then ``max_slots``."""
        padded = np.full(self.max_slots, self.max_slots, np.int32)
        padded[: rows.size] = rows
        if tables is None:
            tables = np.full((self.max_slots, self.blocks_per_seq), NULL_BLOCK, np.int32)
        return {"rows": padded, "tables": tables}

    @functools.cached_property
    def _state_shardings(self) -> dict[str, Any]:
        return jax.tree.map(lambda a: a.sharding, self._state)

    @functools.cached_property
    def _io_shardings(self) -> dict[str, Any]:
        return jax.tree.map(lambda a: a.sharding, self._io)

    @functools.cached_property
    def _write_io_fn(self):
        return jax.jit(_write_io, donate_argnums=(0,), out_shardings=self._io_shardings)

    @functools.cached_property
    def _read_out_fn(self):
        return jax.jit(_read_out)

    # ---- the programs ----------------------------------------------------------------------------
    def _program(self, kind: str, shape: StepShape) -> Any:
        key = (kind, shape)
        if key not in self._programs:
            self._programs[key] = self._build(shape, logits=kind == "logits")
        return self._programs[key]

    def compiled_count(self) -> int:
        """Compiled executables so far (flat after warm-up while serving)."""
        return sum(1 if isinstance(fn, jax.stages.Compiled) else fn._cache_size() for fn in self._programs.values())

    def program_keys(self) -> dict[StepShape, str]:
        """Each step program's compile-cache key (``service.engine.compile_cache``)."""
        facts = self._program_facts()
        return {shape: program_key({**facts, "shape": dataclasses.asdict(shape)}) for shape in self.policy.shapes()}

    def _program_facts(self) -> dict[str, Any]:
        """What every step program of this engine is built from, beyond its shape (a compile-cache
        key's common part: ``service.engine.compile_cache``)."""
        import jaxlib
        from switchyard.kernels.native import library_path

        devices = list(self.mesh.devices.flat)
        client = devices[0].client
        return {
            "source": source_digest(Path(__file__).resolve().parents[2]),
            "kernels": file_digest(library_path()),
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "platform": [client.platform, client.platform_version],
            "devices": [[d.id, d.device_kind] for d in devices],
            "mesh": [list(self.mesh.axis_names), list(self.mesh.devices.shape)],
            "spec": stable_repr(self.spec, UNNAMED),
            "config": stable_repr(self.config, UNNAMED),
            "forward": stable_repr(self._cfg, UNNAMED),
            "policy": stable_repr(self.policy.__dict__),
            # Stated outright, though the arguments' dtypes and the config imply them: an FP8 and a
            # 16-bit program must never share an entry.
            "weights": [[fmt.label for fmt in layer.values()] for layer in self.weight_formats],
            "kv_cache": self.config.kv_cache_dtype,
            "arguments": describe_arguments((self.params, self._state, self._io)),
            "environment": environment_facts(os.environ, ("XLA_FLAGS", ALLOCATOR_ENV, *MEMORY_FRACTION_ENVS)),
        }

    def _build(self, shape: StepShape, logits: bool):
        """The step program of ``shape``; with ``logits``, the same forward returning every row's logits
        [width (+ K: each chunk's last position), padded_vocab] instead of tokens, and changing nothing."""
        cfg, vocab, pp, vocab_axes = self._cfg, self.spec.vocab_size, self.pp, self._vocab_axes
        pools = [self._pool_spec] * (self.spec.num_layers // pp)
        batch, chunk_tokens, kv_len = shape.width, shape.chunk_tokens, shape.kv_len
        with_chunk = shape.with_chunk
        n_chunks = shape.chunks if with_chunk else 0
        aligned = self.policy.chunks_block_aligned
        last = self.max_seq_len - 1

        def shard_fn(params, k, v, tokens, positions, tables, write, temp, top_k, top_p, seeds, counters,
                     c_tokens, c_start, c_len, c_table):
            chunk = Chunk(c_tokens, c_start, c_len, c_table, kv_len, aligned) if with_chunk else None
            if pp == 1:
                out, k, v = budget_forward(params, k, v, tokens, positions, tables, write, chunk, cfg)
            else:
                out, k, v = pipeline_forward(params, k, v, tokens, positions, tables, write, chunk, cfg, pp)
            if logits:
                return jax.lax.all_gather(out, vocab_axes, axis=1, tiled=True), k, v

            def sample(rows: slice) -> jax.Array:
                return sample_sharded(out[rows], vocab, vocab_axes, greedy_only=shape.greedy, temperature=temp[rows],
                                      top_k=top_k[rows], top_p=top_p[rows], seeds=seeds[rows],
                                      counters=counters[rows])

            # The chunks' rows are sampled on their own: sampling batch + 1 rows in one call fails on GPU
            # (an XLA runtime error at 257 rows with top-k / top-p) where batch rows do not.
            n = tokens.shape[0]
            tok = (jnp.concatenate([sample(slice(0, n)), sample(slice(n, n + n_chunks))]) if with_chunk
                   else sample(slice(None)))
            return tok, k, v

        rep = P()
        mapped = jax.shard_map(shard_fn, mesh=self.mesh, in_specs=(self._pspecs, pools, pools) + (rep,) * 13,
                               out_specs=(rep, pools, pools), check_vma=False)
        slots_count = self.max_slots

        def step(params, state, io):
            # Row i decodes slot rows[i]; padding rows (rows[i] == slots_count) read the last slot's
            # state, write nothing and are dropped from the updates.
            tables = io["tables"]
            slots = io["rows"][:batch]
            write = slots < slots_count
            take = jnp.minimum(slots, slots_count - 1)
            samp = [state[key][take] for key in ("temperature", "top_k", "top_p", "seeds", "counters")]
            c_tokens, c_table, c_slot, c_start, c_len, c_completes, c_sampling = _unpack_chunks(
                io["chunks"], tables.shape[1], chunk_tokens, max(n_chunks, 1))
            if with_chunk:
                samp = [jnp.concatenate([a, c.astype(a.dtype)]) for a, c in zip(samp, c_sampling, strict=True)]
            positions = state["positions"][take]
            tok, k, v = mapped(params, state["k"], state["v"], state["tokens"][take], positions, tables[:batch], write,
                               *samp, c_tokens, c_start, c_len, c_table)
            if logits:
                return tok
            new = dict(state, k=k, v=v)
            step_tok = tok[:batch]
            new["tokens"] = state["tokens"].at[slots].set(step_tok, mode="drop")
            new["positions"] = state["positions"].at[slots].set(jnp.minimum(positions + 1, last), mode="drop")
            new["counters"] = state["counters"].at[slots].add(1, mode="drop")
            out = io["out"].at[:batch].set(step_tok)
            if with_chunk:
                # A chunk that completes its prompt starts its slot decoding; the others change nothing
                # (their index is out of range, so dropped: an empty chunk row names slot 0).
                chunk_tok = jnp.where(c_completes, tok[batch:], -1)
                completed = jnp.where(c_completes, c_slot, slots_count)
                temp, top_k, top_p, seed, counter = c_sampling
                for key, value in (("tokens", chunk_tok), ("positions", c_start + c_len), ("counters", counter + 1),
                                   ("temperature", temp), ("top_k", top_k), ("top_p", top_p), ("seeds", seed)):
                    new[key] = new[key].at[completed].set(value.astype(new[key].dtype), mode="drop")
                out = out.at[slots_count: slots_count + n_chunks].set(chunk_tok)
            return new, dict(io, out=out)

        if logits:
            return jax.jit(step)
        options = step_compiler_options(chunk_tokens * n_chunks, self.step_tokens, self.mesh.devices.flat[0].platform,
                                        os.environ)
        return jax.jit(step, donate_argnums=(1, 2), out_shardings=(self._state_shardings, self._io_shardings),
                       compiler_options=options)

    # ---- steps -----------------------------------------------------------------------------------
    def _stage(self, plan: StepPlan) -> None:
        """Write the plan's inputs into ``_io``: the decode rows and their block tables when they
        changed, and the packed chunks when the step carries some."""
        updates: dict[str, np.ndarray] = {}
        if plan.tables is not None:
            updates.update(self._row_arrays(plan.rows, plan.tables))
        if plan.chunks:
            updates["chunks"] = self._pack(plan.chunks)
        if updates:
            self._io = self._write_io_fn(self._io, updates)

    def _pack(self, chunks: Sequence[ChunkPlan]) -> np.ndarray:
        """``chunks`` packed a row each, the rows past them chunks that carry no token (nothing is written)."""
        empty = ChunkPlan(0, np.zeros(0, np.int32), 0, np.full(self.blocks_per_seq, NULL_BLOCK, np.int32), False,
                          SamplingParams(), 0)
        padded = [*chunks, *[empty] * (self.policy.packed_chunks - len(chunks))]
        return np.stack([pack_chunk(self.policy.idle_step_tokens, c.table, c.tokens, c.slot, c.start, c.completes,
                                    c.sampling, c.counter) for c in padded])

    def launch(self, plan: StepPlan) -> PendingStep:
        """Launch one step without waiting for it."""
        self._stage(plan)
        self._state, self._io = self._program("step", plan.shape)(self.params, self._state, self._io)
        tokens = self._read_out_fn(self._io)
        tokens.copy_to_host_async()
        self.step_count += 1
        return PendingStep(self.step_count, tokens, int(plan.rows.size), len(plan.chunks))

    def collect(self, pending: PendingStep) -> StepTokens:
        """Wait for a launched step's tokens."""
        out = np.asarray(pending.tokens)
        return StepTokens(pending.step, out[: pending.rows].copy(),
                          out[self.max_slots: self.max_slots + pending.chunks].copy())

    def logits(self, plan: StepPlan) -> np.ndarray:
        """The logits the plan's step would sample from, float32 [rows (+ one per chunk: its last
        position), vocab], without launching it: nothing changes (launch the plan after). A program of
        its own."""
        self._stage(plan)
        out = np.asarray(self._program("logits", plan.shape)(self.params, self._state, self._io), np.float32)
        rows = [*range(plan.rows.size), *(plan.shape.width + j for j in range(len(plan.chunks)))]
        return out[rows, : self.spec.vocab_size]

    def warmup(self, store: ProgramStore | None = None,
               on_program: Callable[[int, int], None] | None = None) -> WarmUp:
        """Make every step program the policy lists ready and run each once (no slot is in use, so
        nothing is written): loaded from ``store`` where it holds one, else traced, compiled and kept
        there. ``on_program(done, total)`` after each program is ready.

        Tracing holds the GIL, so programs are traced one after another here, while XLA compiles
        them in a thread pool as they come (it releases the GIL): on a 16-core H200 host the load
        benchmark's 86 programs take 108-119 s, where 42 took 218 s one after another (benchmarks/NOTES.md).
        One program of each set with equal products compiles before the rest of its set, so that the
        rest can find XLA's autotuning of those products done (``step_policy.products_first``). XLA's
        autotuner notices of those side-by-side compiles are counted, not shown (``xla_notices``)."""
        t0 = time.perf_counter()
        # The staging program once per set of inputs a step may change, so serving compiles none.
        rows, chunk = self._row_arrays(np.zeros(0, np.int64), None), {"chunks": self._pack(())}
        for updates in (chunk, {**rows, **chunk}, rows):
            self._io = self._write_io_fn(self._io, updates)
        shapes = self.policy.shapes()
        report = on_program or (lambda done, total: None)
        keys = self.program_keys() if store is not None else {}
        devices = list(self.mesh.devices.flat)
        ready, loaded = 0, 0
        compiling: dict[Future, StepShape] = {}

        def collect(finished: Iterable[Future]) -> None:
            """Programs whose compile ended: kept, stored, and counted as they finish (not in order), so
            progress moves while later programs are still being traced."""
            nonlocal ready
            for done in list(finished):
                shape = compiling.pop(done)
                self._programs[("step", shape)] = program = done.result()
                if store is not None:
                    store.save(keys[shape], program)
                ready += 1
                report(ready, len(shapes))

        with autotuner_notices_counted() as notices, ThreadPoolExecutor(compile_workers()) as pool:
            # Stored programs load side by side (deserializing and loading onto the GPUs releases the
            # GIL); only those the store lacks are traced and compiled after.
            loading = {pool.submit(store.load, keys[shape], devices): shape for shape in shapes} if store else {}
            from_store: set[StepShape] = set()
            for done in as_completed(loading):
                program = done.result()
                if program is not None:
                    self._programs[("step", loading[done])] = program
                    from_store.add(loading[done])
                    ready, loaded = ready + 1, loaded + 1
                    report(ready, len(shapes))
            # One program per set of equal products compiles first; the others of its set wait for it
            # (traced meanwhile), so that they find XLA's autotuning of its products done.
            leaders: dict[tuple[int, int, int], Future] = {}
            held: list[tuple[Future, StepShape, Any]] = []

            def release() -> None:
                """Compile the held programs whose leader has finished."""
                nonlocal held
                still = []
                for leader, shape, lowered in held:
                    if leader.done():
                        compiling[pool.submit(lowered.compile)] = shape
                    else:
                        still.append((leader, shape, lowered))
                held = still

            for shape in products_first([s for s in shapes if s not in from_store]):
                lowered = self._program("step", shape).lower(self.params, self._state, self._io)
                if shape.products in leaders:
                    held.append((leaders[shape.products], shape, lowered))
                else:
                    leaders[shape.products] = future = pool.submit(lowered.compile)
                    compiling[future] = shape
                release()
                collect([f for f in compiling if f.done()])
            while held:
                wait({h[0] for h in held}, return_when=FIRST_COMPLETED)
                release()
                collect([f for f in compiling if f.done()])
            collect(as_completed(list(compiling)))
        t_runs = time.perf_counter()
        kind_seconds: dict[bool, float] = {}  # by StepShape.with_chunk
        for with_chunk in (False, True):
            t_kind = time.perf_counter()
            for shape in (s for s in shapes if s.with_chunk == with_chunk):
                self._state, self._io = self._programs[("step", shape)](self.params, self._state, self._io)
            jax.block_until_ready((self._state, self._io))
            kind_seconds[with_chunk] = time.perf_counter() - t_kind
        self._read_out_fn(self._io)
        jax.block_until_ready((self._state, self._io))
        done = time.perf_counter()
        return WarmUp(done - t0, len(shapes), loaded, None if store is None else store.folder, done - t_runs,
                      sum(s.with_chunk for s in shapes), kind_seconds[True], notices.dropped)
