#!/usr/bin/env python3
"""Token-budget steps under a mixed state: sequences decoding while a prompt goes through in chunks.

For each ``--state N:C`` (N sequences decoding at context C, seated by ``benchmarks/drive.py``: their
random prompts computed in real chunk steps), a prompt of ``--prompt`` random tokens is computed in
chunks of ``--step-tokens`` beside them, then the same sequences decode alone for ``--decode-steps``
steps. Every step is planned by the engine's step policy over the benchmark's KV books and launched as
the scheduler launches it: the next one before the previous one's tokens are collected, so the host's
launch overlaps the device's work. Reported per state: the median over ``--repeats`` of ms per step with
a chunk and per decode-only step, and the median host time of launching each kind (the call that
enqueues the step: when it nears the step's own time, the device waits for the host); with
``--profile-dir``, a profiler summary of one prompt's chunk steps (GPU busy time and span per step, top
kernels): where a chunk step's time goes. Every sequence is greedy unless ``--temperature`` (with
``--top-k``, ``--top-p``) makes them sample: greedy traffic against sampled traffic.

    python benchmarks/chunk_steps.py --state 20:1536 8:1024 --prompt 3072 --profile-dir /tmp/prof \\
        --out benchmarks/results/current/chunk-steps-h200.json
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from switchyard.service.engine.xla_runtime import apply_process_defaults, xla_allocator


@functools.cache
def sibling(name: str) -> dict:
    """Another benchmark script's functions (drive.py's engines and steps, decode.py's profiler,
    result_file.py's provenance and writing)."""
    return runpy.run_path(str(Path(__file__).with_name(f"{name}.py")))


def parse_state(text: str) -> tuple[int, int]:
    try:
        count, context = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a state is DECODING:CONTEXT, got {text!r}") from None
    if count < 0 or context < 1:
        raise argparse.ArgumentTypeError(f"a state needs DECODING >= 0 and CONTEXT >= 1, got {text!r}")
    return count, context


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--batch-slots", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=4352)
    parser.add_argument("--step-tokens", type=int, default=256)
    parser.add_argument("--state", type=parse_state, nargs="+", default=[(20, 1536), (8, 1024)],
                        help="DECODING:CONTEXT, one or more")
    parser.add_argument("--prompt", type=int, default=3072, help="tokens of the prompt computed in chunks")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=40, help="decode-only steps per repeat")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="every sequence samples at this temperature (0: greedy; the greedy-only programs)")
    parser.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus (1: off)")
    parser.add_argument("--profile-dir", default=None, help="also profile one prompt's chunk steps per state")
    parser.add_argument("--cpu", action="store_true", help="host devices (JAX_PLATFORMS=cpu): a smoke test of tiny")
    parser.add_argument("--out", default=None, help="result JSON path")
    args = parser.parse_args(argv)
    from switchyard.service.engine.sampling import SamplingParams
    from switchyard.service.errors import InvalidRequestError

    args.sampling = SamplingParams(args.temperature, args.top_k, args.top_p, seed=7)
    try:
        args.sampling.validate()
    except InvalidRequestError as e:
        parser.error(str(e))
    if args.repeats < 1 or args.decode_steps < 2:
        parser.error("--repeats must be at least 1 and --decode-steps at least 2")
    for count, context in args.state:
        if count >= args.batch_slots:
            parser.error(f"{count} decoding sequences leave no slot of {args.batch_slots} for the prompt")
        # Every step moves the decoding sequences one position on; they must stay inside their context.
        chunks = -(-args.prompt // args.step_tokens)
        steps = (args.repeats + 2) * (chunks + args.decode_steps) + 8
        if context + steps >= args.max_seq_len or args.prompt >= args.max_seq_len:
            parser.error(f"state {count}:{context} with a {args.prompt}-token prompt runs past --max-seq-len "
                         f"{args.max_seq_len} ({steps} steps)")
    return args


def pipelined(engine, launches: Iterator) -> tuple[float, int]:
    """ms per step of the steps ``launches`` launches, each before the previous one is collected, and
    how many there were."""
    previous, marks = None, []
    for pending in launches:
        if previous is not None:
            engine.collect(previous)
            marks.append(time.perf_counter())
        previous = pending
    engine.collect(previous)
    marks.append(time.perf_counter())
    return 1e3 * (marks[-1] - marks[0]) / max(len(marks) - 1, 1), len(marks)


def chunk_steps(engine, kv, slot: int, prompt: list[int], sampling, launch_ms: list[float] | None = None
                ) -> tuple[float, int]:
    """ms per step of ``prompt``'s chunk steps beside the decoding sequences of ``kv``, and how many
    there were; the prompt samples with ``sampling``; each launch's host time goes on ``launch_ms``. The
    prompt's slot is free again after."""
    if kv.begin(slot, prompt, sampling, reuse_prefix=False) is None:
        raise RuntimeError("the pool has too few blocks for the prompt")

    def launches() -> Iterator:
        while kv.sequence(slot).left:
            yield sibling("drive")["launch_step"](engine, kv, slot, launch_ms)

    timed = pipelined(engine, launches())
    kv.evict(slot)
    return timed


def decode_steps(engine, kv, steps: int, launch_ms: list[float] | None = None) -> float:
    launch_step = sibling("drive")["launch_step"]
    return pipelined(engine, (launch_step(engine, kv, None, launch_ms) for _ in range(steps)))[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    apply_process_defaults()  # as serve's engine process
    import jax
    import numpy as np
    from switchyard.service.modelspec import KV_BLOCK_TOKENS, preset

    drive = sibling("drive")
    spec = preset(args.preset)
    most = max(count for count, _ in args.state)
    # A pool for the most decoding sequences of any state and the prompt, each with its whole table.
    config = drive["whole_tables_config"](args.batch_slots, args.max_seq_len, tables=most + 1, strategy="xla",
                                          dtype="bfloat16", step_tokens=args.step_tokens)
    engine = drive["random_engine"](spec, config)
    rng = np.random.default_rng(0)
    rows = []
    for count, context in args.state:
        kv = drive["books"](engine)
        t0 = time.perf_counter()
        drive["seat"](engine, kv, count, context, seed=count, sampling=args.sampling)
        seat_s = time.perf_counter() - t0
        prompt = drive["random_prompt"](rng, spec.vocab_size, args.prompt)
        t0 = time.perf_counter()
        _, chunks = chunk_steps(engine, kv, count, prompt, args.sampling)  # compiles what this state runs
        if count:
            decode_steps(engine, kv, 2)
        compile_s = time.perf_counter() - t0
        chunk_launch: list[float] = []
        decode_launch: list[float] = []
        chunk_ms = statistics.median(chunk_steps(engine, kv, count, prompt, args.sampling, chunk_launch)[0]
                                     for _ in range(args.repeats))
        decode_ms = statistics.median(decode_steps(engine, kv, args.decode_steps, decode_launch)
                                      for _ in range(args.repeats)) if count else None
        row = {"decoding": count, "context": context, "prompt": args.prompt, "chunk_steps": chunks,
               "chunk_step_ms": round(chunk_ms, 3),
               "decode_step_ms": None if decode_ms is None else round(decode_ms, 3),
               "chunk_launch_ms": round(statistics.median(chunk_launch), 3),
               "decode_launch_ms": round(statistics.median(decode_launch), 3) if decode_launch else None,
               "seat_s": round(seat_s, 1), "first_run_s": round(compile_s, 1)}
        decode_text = "-" if decode_ms is None else f"{decode_ms:.3f} ms (launched in {row['decode_launch_ms']:.3f})"
        print(f"{count} decoding at {context}: chunk step {chunk_ms:.3f} ms ({chunks} per prompt, launched in "
              f"{row['chunk_launch_ms']:.3f}), decode-only step {decode_text}", flush=True)
        if args.profile_dir:
            decode = sibling("decode")
            kernels, _ = decode["trace_gpu"](functools.partial(chunk_steps, engine, kv, count, prompt, args.sampling),
                                             f"{args.profile_dir}/{count}-{context}")
            row["profile"] = decode["step_profile"](kernels, chunks)
        rows.append(row)
    device = f"{jax.device_count()}x {jax.devices()[0].device_kind}"
    result = {
        **sibling("result_file")["provenance"](device, argv, script=__file__),
        "jax": jax.__version__,
        "xla_allocator": xla_allocator(),
        "config": {"preset": args.preset, "batch_slots": args.batch_slots, "max_seq_len": args.max_seq_len,
                   "step_tokens": args.step_tokens, "kv_block_tokens": KV_BLOCK_TOKENS,
                   "sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p}},
        "rows": rows,
    }
    if args.out:
        sibling("result_file")["write_result"](args.out, result)
        print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
