"""Time to first token of a prompt alone, and with a cached prefix, through the engine's chunked steps.

A prompt alone is computed in chunks of ``--step-tokens`` (one engine step each, planned by the
engine's step policy over the benchmark's KV books, as serving runs it; the last step samples the
first token): its time is the wall time from the prompt's begin in the books to the first token on
the host. Prefix reuse: a prompt of ``--shared-prefix`` tokens plus ``--suffix`` new ones, first with
the prefix cache empty, then a second prompt with the same prefix and other new tokens, whose full
blocks of the prefix come from the cache.

The peer (``--peer torch``): the same shape in plain PyTorch, eager, cuBLAS products and SDPA's causal
attention (flash), one pass over the whole prompt (``torch_peer.prefill_last_logits``). It runs first,
before JAX takes the GPU's memory.

    python benchmarks/prefill.py --prompt 1024 4096 --step-tokens 256 512 --peer torch
    python benchmarks/prefill.py --cpu --model tiny --prompt 40 --step-tokens 16 --shared-prefix 64 \
        --suffix 8 --repeats 1 --batch-slots 2 --no-warmup

``--profile-dir`` adds, per step budget, a JAX profiler summary (GPU busy time per step, top kernels)
of the longest prompt alone, of a prompt whose ``--shared-prefix`` is cached, and of a mixed load:
``--profile-decoding`` sequences decoding at context ``--profile-context`` while a prompt of
``--shared-prefix`` tokens goes through in chunks, beside decode-only steps of the same sequences
(as many as leave the pool room for that prompt; seated by ``benchmarks/drive.py``). The profiler
runs XLA's command buffers kernel by kernel, so the cached prompt's host phases (begin, launch, wait
for the token) are timed outside it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

from switchyard.service.engine.xla_runtime import apply_process_defaults, xla_allocator

ROOT = Path(__file__).resolve().parent.parent


def peer_times(args: argparse.Namespace) -> dict:
    import torch

    peer = runpy.run_path(str(Path(__file__).with_name("torch_peer.py")))
    from switchyard.service.modelspec import preset

    spec = preset(args.model)
    model = peer["build"](spec, batch=1, max_seq=max(args.prompt), device="cuda")
    out = {"implementation": "PyTorch eager: cuBLAS products, SDPA causal attention (flash)",
           "torch": torch.__version__, "rows": []}
    with torch.no_grad():
        for length in args.prompt:
            tokens = torch.randint(3, spec.vocab_size, (1, length), device="cuda")
            times = []
            for i in range(args.repeats + 2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                peer["prefill_last_logits"](model, tokens).argmax(-1).item()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            ms = 1000 * statistics.median(times)
            out["rows"].append({"prompt": length, "ms": round(ms, 3)})
            print(f"peer: prompt {length:5d} {ms:8.2f} ms", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return out


def first_token_phases(engine, kv, prompt: list[int],
                       reuse_prefix: bool) -> tuple[tuple[float, float, float], int, int]:
    """Seconds of the prompt's begin in ``kv`` (prefix lookup, blocks), of planning and launching its
    steps and of waiting for the first token on the host after the last launch; the cached tokens;
    the steps the prompt took. Its slot (0) is free again after."""
    from switchyard.service.engine.sampling import SamplingParams

    t0 = time.perf_counter()
    cached = kv.begin(0, prompt, SamplingParams(), reuse_prefix=reuse_prefix)
    if cached is None:
        raise RuntimeError("the pool has too few blocks for the prompt")
    t1 = time.perf_counter()
    steps = 0
    while kv.sequence(0).left:
        pending = drive()["launch_step"](engine, kv, 0)
        steps += 1
    t2 = time.perf_counter()
    engine.collect(pending)
    t3 = time.perf_counter()
    kv.evict(0)
    return (t1 - t0, t2 - t1, t3 - t2), cached, steps


def time_to_first_token(engine, kv, prompt: list[int], reuse_prefix: bool) -> tuple[float, int, int]:
    """Seconds from the prompt's begin to its first token on the host; the cached tokens; the steps."""
    phases, cached, steps = first_token_phases(engine, kv, prompt, reuse_prefix)
    return sum(phases), cached, steps


def host_phases(engine, kv, prefix: list[int], rng, args: argparse.Namespace, runs: int = 5) -> dict:
    """Median µs of each of :func:`first_token_phases` for prompts whose ``prefix`` is cached."""
    vocab = engine.spec.vocab_size
    samples = [first_token_phases(engine, kv, prefix + drive()["random_prompt"](rng, vocab, args.suffix), True)[0]
               for _ in range(runs)]
    return {key: round(1e6 * statistics.median(s[i] for s in samples), 1)
            for i, key in enumerate(("begin_us", "launch_us", "wait_us"))}


@functools.cache
def sibling(name: str) -> dict:
    """Another benchmark script's functions, loaded once."""
    return runpy.run_path(str(Path(__file__).with_name(f"{name}.py")))


def drive() -> dict:
    """drive.py's: engines built through EngineConfig, driven through the step contract."""
    return sibling("drive")


def profile(engine, kv, rng, args: argparse.Namespace, out_dir: str) -> dict:
    """Profiler summaries of a prompt alone and of chunk steps beside decoding sequences."""
    from switchyard.service.engine.sampling import SamplingParams

    trace_gpu, summarise = sibling("decode")["trace_gpu"], sibling("decode")["step_profile"]
    launch_step, prompt_of = drive()["launch_step"], drive()["random_prompt"]
    vocab = engine.spec.vocab_size
    alone = prompt_of(rng, vocab, max(args.prompt))
    runs: list[tuple[float, int, int]] = []
    kernels, _ = trace_gpu(lambda: runs.append(time_to_first_token(engine, kv, alone, False)), f"{out_dir}/alone")
    out = {"prompt_alone": {"prompt": len(alone), **summarise(kernels, runs[-1][2])}}
    prefix = prompt_of(rng, vocab, args.shared_prefix)
    kv.pool.clear_cache()
    time_to_first_token(engine, kv, prefix + prompt_of(rng, vocab, args.suffix), True)
    suffix = prompt_of(rng, vocab, args.suffix)
    kernels, _ = trace_gpu(lambda: runs.append(time_to_first_token(engine, kv, prefix + suffix, True)),
                           f"{out_dir}/cached")
    out["cached_prefix"] = {"shared_prefix": args.shared_prefix, "suffix": args.suffix,
                            "wall_us": round(1e6 * runs[-1][0], 1), **host_phases(engine, kv, prefix, rng, args),
                            **summarise(kernels, runs[-1][2])}
    # As many decoding sequences as leave the pool room for the chunked prompt beside them, each
    # growing by a token per step: the decode-only steps, then the chunked prompt twice.
    warm_steps, traced_steps = 4, 16
    chunked_steps = -(-args.shared_prefix // engine.step_tokens)  # at most; a surge takes fewer
    grown = warm_steps + traced_steps + 2 * chunked_steps + 1
    kv.pool.clear_cache()
    room = kv.free_blocks() - kv.pool.blocks_for(args.shared_prefix)
    n = min(args.profile_decoding, engine.max_slots - 1, room // kv.pool.blocks_for(args.profile_context + grown))
    drive()["seat"](engine, kv, n, args.profile_context, seed=1)  # sequences decoding at --profile-context

    def decode_steps(count: int) -> None:
        for _ in range(count):
            engine.collect(launch_step(engine, kv))

    decode_steps(warm_steps)
    kernels, _ = trace_gpu(lambda: decode_steps(traced_steps), f"{out_dir}/decode")
    out["decode_only"] = {"decoding": n, "context": args.profile_context, **summarise(kernels, traced_steps)}
    prompt = prompt_of(rng, vocab, args.shared_prefix)

    def chunk_steps() -> int:
        if kv.begin(n, prompt, SamplingParams(), reuse_prefix=False) is None:
            raise RuntimeError("the pool has too few blocks for the chunked prompt")
        steps = 0
        while kv.sequence(n).left:
            engine.collect(launch_step(engine, kv, n))
            steps += 1
        kv.evict(n)
        return steps

    chunk_steps()
    steps = []
    kernels, _ = trace_gpu(lambda: steps.append(chunk_steps()), f"{out_dir}/mixed")
    out["chunk_beside_decoding"] = {"decoding": n, "context": args.profile_context, "prompt": len(prompt),
                                    **summarise(kernels, steps[0])}
    for slot in range(n):
        kv.evict(slot)
    print(f"  cached prefix: begin {out['cached_prefix']['begin_us']:.0f} us, launch "
          f"{out['cached_prefix']['launch_us']:.0f} us, wait {out['cached_prefix']['wait_us']:.0f} us", flush=True)
    for name, row in out.items():
        print(f"  profile {name}: GPU busy {row['gpu_busy_us_per_step']:.0f} us/step over "
              f"{row['gpu_span_us_per_step']:.0f} us/step", flush=True)
        for k in row["top_kernels"][:12]:
            print(f"    {k['total_us_per_step']:9.1f} us x{k['count']:5d}  {k['name']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--prompt", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--step-tokens", type=int, nargs="+", default=[256])
    parser.add_argument("--shared-prefix", type=int, default=2048)
    parser.add_argument("--suffix", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peer", choices=["torch"], default=None)
    parser.add_argument("--profile-dir", default=None, help="also profile (see the module docstring)")
    parser.add_argument("--profile-decoding", type=int, default=16)
    parser.add_argument("--profile-context", type=int, default=1024)
    parser.add_argument("--batch-slots", type=int, default=8)
    parser.add_argument("--weights", nargs="+", default=["bf16"], choices=sorted(sibling("decode")["WEIGHTS"]),
                        help="layer matrices: bf16, or FP8 quantized at load (the engine's product policy); "
                             "each format on random weights of its own, one after the other")
    parser.add_argument("--kv-cache", nargs="+", default=["auto"], choices=["auto", "fp8"],
                        help="KV cache: the model's dtype, or FP8 with a scale per position and head; each "
                             "after the other on the same weights")
    parser.add_argument("--no-warmup", action="store_true",
                        help="compile each program on first use (the untimed first run of each measure) instead "
                             "of every program first; no warm-up row")
    parser.add_argument("--cpu", action="store_true", help="host devices (JAX_PLATFORMS=cpu): a smoke test of tiny")
    parser.add_argument("--out", default=None, help="result JSON path")
    args = parser.parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    apply_process_defaults()  # as serve's engine process
    peer = peer_times(args) if args.peer else None

    import jax
    import numpy as np
    from switchyard.service.engine.engine import EngineConfig
    from switchyard.service.modelspec import KV_BLOCK_TOKENS, preset

    spec = preset(args.model)
    rng = np.random.default_rng(0)
    prompt_of = drive()["random_prompt"]
    longest = max(*args.prompt, args.shared_prefix + args.suffix)
    max_seq = -(-(longest + 64) // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    rows = []
    for weights_kind in args.weights:
        weights = None  # this format's random weights, shared by its step budgets and KV formats
        for kv_cache, step_tokens in itertools.product(args.kv_cache, args.step_tokens):
            at = {"weights": weights_kind, "kv_cache": kv_cache, "step_tokens": step_tokens}  # every row's
            config = EngineConfig(batch_slots=args.batch_slots, max_seq_len=max_seq, strategy="xla", dtype="bfloat16",
                                  kv_tokens=max(4, args.batch_slots // 2) * max_seq, step_tokens=step_tokens,
                                  kv_cache_dtype=kv_cache, **sibling("decode")["WEIGHTS"][weights_kind])
            if weights is None:
                engine = drive()["random_engine"](spec, config)
                weights = drive()["weights_of"](engine)
            else:
                engine = drive()["engine_on"](weights, config)
            if not args.no_warmup:
                warm = engine.warmup().seconds
                print(f"{weights_kind}, KV {kv_cache}, step tokens {step_tokens}: warm-up {warm:.1f} s", flush=True)
                rows.append({"kind": "warm-up", **at, "programs": engine.compiled_count(),
                             "s": round(warm, 1)})
            kv = drive()["books"](engine)
            for length in args.prompt:
                times = []
                for i in range(args.repeats + 1):
                    elapsed, _, steps = time_to_first_token(engine, kv, prompt_of(rng, spec.vocab_size, length),
                                                            reuse_prefix=False)
                    if i:
                        times.append(elapsed)
                ms = 1000 * statistics.median(times)
                rows.append({"kind": "prompt alone", **at, "prompt": length, "ms": round(ms, 3),
                             "steps": steps})
                print(f"  prompt {length:5d} alone: {ms:8.2f} ms ({steps} steps)", flush=True)
            firsts, seconds = [], []
            for i in range(args.repeats + 1):
                kv.pool.clear_cache()
                prefix = prompt_of(rng, spec.vocab_size, args.shared_prefix)
                first, cached_first, _ = time_to_first_token(
                    engine, kv, prefix + prompt_of(rng, spec.vocab_size, args.suffix), True)
                second, cached, _ = time_to_first_token(
                    engine, kv, prefix + prompt_of(rng, spec.vocab_size, args.suffix), True)
                assert cached_first == 0 and cached == args.shared_prefix // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS
                if i:
                    firsts.append(first)
                    seconds.append(second)
            f_ms, s_ms = 1000 * statistics.median(firsts), 1000 * statistics.median(seconds)
            rows.append({"kind": "shared prefix", **at, "shared_prefix": args.shared_prefix,
                         "suffix": args.suffix, "first_ms": round(f_ms, 3), "second_ms": round(s_ms, 3),
                         "cached_tokens": cached, "second_over_first": round(s_ms / f_ms, 4)})
            print(f"  shared prefix {args.shared_prefix} + {args.suffix}: first {f_ms:.2f} ms, second {s_ms:.2f} ms "
                  f"({100 * s_ms / f_ms:.1f}%)", flush=True)
            if args.profile_dir:
                rows.append({"kind": "profile", **at,
                             **profile(engine, kv, rng, args,
                                       f"{args.profile_dir}/{weights_kind}-kv-{kv_cache}-{step_tokens}")})
            del engine, kv
            gc.collect()
    device = jax.devices()[0]
    result = {
        **sibling("result_file")["provenance"](f"{jax.device_count()}x {device.device_kind}", argv, script=__file__),
        "jax": jax.__version__,
        "model": args.model,
        "xla_allocator": xla_allocator(),
        "rows": rows,
    }
    if peer is not None:
        result["peer"] = peer
    if args.out:
        sibling("result_file")["write_result"](args.out, result)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
