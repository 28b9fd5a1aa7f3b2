"""``switchyard demo``: the embedded tiny model generating text, with per-token timings.

Writes a random-weight tiny checkpoint (unless given one), loads it through the same path as
``switchyard serve``, generates with the continuous-batching scheduler and prints each token's latency.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import threading
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default="The quick brown fox", help="prompt text")
    parser.add_argument("--model-path", help="a Hugging Face checkpoint folder (default: a fresh tiny model)")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size (devices)")


def run(args: argparse.Namespace) -> int:
    from switchyard.service.checkpoint import write_checkpoint
    from switchyard.service.engine import Engine
    from switchyard.service.modelspec import ServingLayout, preset
    from switchyard.service.sampling import SamplingParams
    from switchyard.service.scheduler import GenerationRequest, Scheduler, TokenEvent
    from switchyard.service.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        path = args.model_path or str(write_checkpoint(preset("tiny"), scratch, progress=False))
        layout = ServingLayout(tp=args.tp, batch_slots=4, max_seq_len=256)
        engine = Engine.from_checkpoint(path, layout)
        print(f"compiling {engine.spec.name} (tp={args.tp}) ...", flush=True)
        print(f"warm-up took {engine.warmup():.1f} s")
        tokenizer = Tokenizer.from_dir(path, engine.spec)
        scheduler = Scheduler(engine, tokenizer)
        done = threading.Event()
        events: list[TokenEvent] = []

        def on_event(event: TokenEvent) -> None:
            events.append(event)
            print(event.text, end="", flush=True)
            if event.finish_reason:
                done.set()

        stop = threading.Event()
        loop = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
        loop.start()
        t0 = time.monotonic()
        print(f"\n{args.prompt}", end="", flush=True)
        scheduler.submit(GenerationRequest(
            "demo", tokenizer.encode(args.prompt), args.max_tokens,
            SamplingParams(temperature=args.temperature, seed=args.seed), on_event=on_event))
        done.wait()
        stop.set()
        loop.join()
    print(f"\n\nfinish: {events[-1].finish_reason}\n{'token':>5} {'id':>6} {'ms':>8} {'step':>5}  text")
    last = t0
    for e in events:
        if e.token_id is None:
            continue
        print(f"{e.index:5d} {e.token_id:6d} {1000 * (e.time - last):8.2f} {e.step:5d}  {e.text!r}")
        last = e.time
    gaps = [b.time - a.time for a, b in itertools.pairwise(events) if b.token_id is not None]
    if gaps:
        print(f"time to first token {1000 * (events[0].time - t0):.1f} ms, "
              f"mean time per output token {1000 * sum(gaps) / len(gaps):.2f} ms")
    return 0
