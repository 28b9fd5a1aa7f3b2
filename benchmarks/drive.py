"""Engines for benchmarks: built from the benchmark's arguments through ``EngineConfig`` alone, and
driven through the public step contract (``service/engine/plan.py``) as the scheduler drives them.

Building: random weights of a preset (:func:`random_engine`, and :func:`engine_on` for another
configuration on the weights of an engine already built), or a checkpoint as ``switchyard serve``
loads it (:func:`serving_engine`). Every departure from what serve runs (XLA's attention ops, another
split of the row-parallel products, the narrowest decode width) is a field of ``EngineConfig``.

Driving: the KV books are a :class:`~switchyard.service.engine.kv_manager.KVManager` of the
benchmark's own (:func:`books`), every step is planned by ``engine.policy`` and launched with
``engine.launch`` (:func:`launch_step`). :func:`seat` puts sequences at a context by running random
prompts through real chunk steps, so the timed KV holds the model's values (benchmarks never time on
zeros) and nothing private is written. :func:`time_decode` times decode steps as the scheduler runs
them: step n+1 is launched before step n's tokens are collected.

Benchmarks import this file as a sibling module (``runpy``); tests load it with
``helpers.scripts.load("drive")``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh
from switchyard.service.engine.compile_cache import WarmUp
from switchyard.service.engine.engine import Engine, EngineConfig, PendingStep
from switchyard.service.engine.heap import freeze_warm_heap
from switchyard.service.engine.kv_manager import KVManager
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.step_policy import StepPolicy
from switchyard.service.modelspec import (
    DEFAULT_KV_MEMORY_FRACTION,
    DEFAULT_STEP_TOKENS,
    KV_BLOCK_TOKENS,
    ModelSpec,
    ServingLayout,
    preset,
)

FIRST_TOKEN = 3  # random prompt ids start here (below it: the tiny preset's padding, BOS and EOS)


# ---- building --------------------------------------------------------------------------------------


def whole_tables_config(slots: int, max_seq_len: int, block_size: int = KV_BLOCK_TOKENS, *,
                        tables: int | None = None, **changes: Any) -> EngineConfig:
    """A configuration whose KV pool holds ``tables`` whole block tables (by default one per slot):
    the sequences a benchmark runs never run short of blocks, and the pool takes no more memory than
    they can use."""
    blocks = -(-max_seq_len // block_size)
    return EngineConfig(batch_slots=slots, max_seq_len=max_seq_len, block_size=block_size,
                        kv_tokens=(slots if tables is None else tables) * blocks * block_size, **changes)


def random_engine(spec: ModelSpec, config: EngineConfig, *, tp: int = 1, pp: int = 1, seed: int = 0,
                  devices: Sequence[jax.Device] | None = None) -> Engine:
    """Random weights of ``spec`` on ``pp`` stages of ``tp`` devices (by default the first of
    ``jax.devices()``; a pipeline group's processes see every stage's), served as ``config`` says."""
    return Engine.from_random(spec, ServingLayout(tp=tp, pp=pp), config, seed=seed, devices=devices)


class Weights(NamedTuple):
    """An engine's weights on its devices, for more engines in other configurations."""

    spec: ModelSpec
    params: dict
    mesh: Mesh


def weights_of(engine: Engine) -> Weights:
    return Weights(engine.spec, engine.params, engine.mesh)


def engine_on(weights: Weights, config: EngineConfig) -> Engine:
    """An engine on ``weights``, served as ``config`` says (the engine they came from should be gone
    first, so that its KV pool gives its memory back)."""
    return Engine(weights.spec, weights.params, weights.mesh, config)


def serving_layout(args: Any) -> ServingLayout:
    """The layout of a serving benchmark's arguments (``tp``, ``strategy``, ``batch_slots``,
    ``max_seq_len``, and optionally ``kv_tokens``, ``kv_memory_fraction``, ``step_tokens``,
    ``quantization``, ``kv_cache_dtype``)."""
    return ServingLayout(tp=args.tp, strategy=args.strategy, batch_slots=args.batch_slots,
                         max_seq_len=args.max_seq_len, kv_tokens=getattr(args, "kv_tokens", 0),
                         kv_memory_fraction=getattr(args, "kv_memory_fraction", DEFAULT_KV_MEMORY_FRACTION),
                         step_tokens=getattr(args, "step_tokens", DEFAULT_STEP_TOKENS),
                         quantization=getattr(args, "quantization", "auto"),
                         kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))


def serving_tokenizer(args: Any) -> tuple[ModelSpec, Any]:
    """The model spec and tokenizer of :func:`serving_engine`'s engine, with no device touched."""
    from switchyard.service.engine.tokenizer import Tokenizer, build_tokenizer

    if args.model_path:
        return ModelSpec.from_file(args.model_path), Tokenizer.from_dir(args.model_path)
    spec = preset(args.preset)
    return spec, Tokenizer(build_tokenizer(spec), spec.eos_token_ids, spec.vocab_size)


def serving_engine(args: Any) -> tuple[Engine, WarmUp]:
    """The warmed-up engine and the warm-up's seconds, for a serving benchmark (``args``:
    ``model_path`` or ``preset``, ``dtype`` and :func:`serving_layout`'s): a checkpoint's, configured
    from the layout as ``switchyard serve`` does, or random weights of a preset in the same
    configuration (the requests compute their own KV before any step reads it). Its warm heap is
    frozen, as serve's engine process does."""
    layout = serving_layout(args)
    if args.model_path:
        config = EngineConfig.from_layout(layout, dtype=args.dtype)
        engine = Engine.from_checkpoint(args.model_path, layout, config, progress=False)
    else:
        spec = preset(args.preset)
        config = EngineConfig.from_layout(layout, dtype=args.dtype or spec.dtype)
        engine = Engine.from_random(spec, layout, config)
    print(f"KV pool: {engine.kv_tokens} tokens in blocks of {engine.kv_block_size} "
          f"({engine.kv_tokens / layout.max_seq_len:.1f} sequences at the full context); "
          f"steps carry up to {engine.step_tokens} prompt tokens", flush=True)
    warmup = engine.warmup()
    print(f"warm-up: {warmup.seconds:.1f} s", flush=True)
    frozen, collect_ms = freeze_warm_heap()
    t0 = time.perf_counter()
    gc.collect()
    print(f"heap: {frozen} objects frozen; a full collection took {collect_ms:.0f} ms before, "
          f"{1e3 * (time.perf_counter() - t0):.1f} ms after", flush=True)
    return engine, warmup


# ---- driving ---------------------------------------------------------------------------------------


def books(engine: Any) -> KVManager:
    """Empty KV books for ``engine`` (an ``Engine``, or a pipeline group's stage 0), as the scheduler
    makes them."""
    return KVManager(max_slots=engine.max_slots, max_seq_len=engine.max_seq_len, kv_tokens=engine.kv_tokens,
                     block_size=engine.kv_block_size)


def random_prompt(rng: np.random.Generator, vocab_size: int, length: int) -> list[int]:
    return [int(t) for t in rng.integers(FIRST_TOKEN, vocab_size, length)]


def launch_step(engine: Any, kv: KVManager, chunk_slot: int | None = None,
                launch_ms: list[float] | None = None) -> PendingStep:
    """What the scheduler does to launch a step: the decoding sequences' next blocks, the policy's
    plan (with the next chunk of ``chunk_slot``'s prompt when given), the launch, and the books'
    record of it. The host time of ``engine.launch`` alone goes on ``launch_ms``."""
    if not kv.ensure_decode_blocks():
        raise RuntimeError("the KV pool ran out of blocks for the decoding sequences")
    plan = engine.policy.plan(kv, [] if chunk_slot is None else [chunk_slot])
    if plan is None:
        raise RuntimeError("nothing to launch: no sequence decodes and no prompt was given")
    t0 = time.perf_counter()
    pending = engine.launch(plan)
    if launch_ms is not None:
        launch_ms.append(1e3 * (time.perf_counter() - t0))
    kv.launched(plan)
    return pending


def chunk_count(policy: StepPolicy, length: int, decoding: bool) -> int:
    """The steps a prompt of ``length`` tokens takes alone in the chunks ``policy`` gives it (beside
    decoding sequences, or with none), with no backlog."""
    steps, left = 0, length
    while left:
        left -= policy.chunk_length(left, decoding, 0)
        steps += 1
    return steps


def seat_lengths(policy: StepPolicy, batch: int, context: int) -> list[int]:
    """Prompt lengths that put ``batch`` sequences, their prompts computed one after another, all at
    position ``context`` once the last prompt's last chunk is launched. Every step after a prompt's
    last chunk moves that sequence one position on, so each prompt is shorter by the steps of the
    prompts after it."""
    lengths: list[int] = []
    later = 0
    for i in reversed(range(batch)):
        length = context - later
        if length < 1:
            raise ValueError(f"cannot seat {batch} sequences at context {context}: the prompts after the "
                             f"first take {later} steps or more")
        lengths.append(length)
        later += chunk_count(policy, length, decoding=i > 0)
    return lengths[::-1]


def seat(engine: Any, kv: KVManager, batch: int, context: int, seed: int = 0,
         sampling: SamplingParams | None = None) -> list[list[int]]:
    """Begin ``batch`` sequences of random prompts in slots ``0..batch-1`` of empty books and compute
    their prompts in real chunk steps, one prompt after another, until every one decodes at position
    ``context`` (:func:`seat_lengths`); returns the prompts. Every step is collected before the next."""
    if kv.decoding().size or kv.prefilling():
        raise ValueError("seat takes empty books")
    rng = np.random.default_rng(seed)
    lengths = seat_lengths(engine.policy, batch, context)
    prompts = [random_prompt(rng, engine.spec.vocab_size, n) for n in lengths]
    for slot, prompt in enumerate(prompts):
        if kv.begin(slot, prompt, sampling or SamplingParams(), reuse_prefix=False) is None:
            raise RuntimeError(f"the KV pool has too few blocks for {batch} prompts of up to {context} tokens")
    for slot in range(batch):
        while kv.sequence(slot).left:
            engine.collect(launch_step(engine, kv, slot))
    positions = {kv.sequence(slot).position for slot in range(batch)}
    if positions - {context}:
        raise RuntimeError(f"seated at positions {sorted(positions)}, not {context}")
    return prompts


class Timed(NamedTuple):
    times: list[float]  # seconds of each timed step
    tokens: int  # decode tokens the timed steps brought to the host
    launch_ms: list[float]  # host milliseconds of each timed step's launch call (near its step time: host-bound)


def time_decode(engine: Any, kv: KVManager, steps: int, warmup: int) -> Timed:
    """Decode steps of every sequence in ``kv`` as the scheduler runs them: launch step n+1 (its
    blocks, plan, launch and record), then collect step n's tokens, so the host's work overlaps the
    device's. The first ``warmup`` of the timed loop's iterations are not counted."""
    pending = launch_step(engine, kv)
    times: list[float] = []
    launch_ms: list[float] = []
    tokens = 0
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        following = launch_step(engine, kv, launch_ms=launch_ms if i >= warmup else None)
        got = engine.collect(pending)
        pending = following
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            tokens += int(got.tokens.size)
    engine.collect(pending)
    return Timed(times, tokens, launch_ms)


def time_synchronous(engine: Any, kv: KVManager, steps: int, warmup: int) -> list[float]:
    """Seconds of decode steps when each one's tokens are collected before the next is launched."""
    for _ in range(warmup):
        engine.collect(launch_step(engine, kv))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.collect(launch_step(engine, kv))
        times.append(time.perf_counter() - t0)
    return times
