"""``switchyard make-checkpoint``: write a random-weight checkpoint in Hugging Face format."""

from __future__ import annotations

import argparse
import dataclasses

from switchyard.service.modelspec import PRESETS, preset


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True, help="model shape")
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the preset's dtype")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="split weights into files of about this size")


def run(args: argparse.Namespace) -> int:
    from switchyard.service.engine.checkpoint import write_checkpoint

    spec = preset(args.preset)
    if args.dtype:
        spec = dataclasses.replace(spec, dtype=args.dtype)
    out = write_checkpoint(spec, args.out, seed=args.seed, shard_bytes=int(args.shard_gb * (1 << 30)))
    print(f"wrote {spec.name} ({spec.param_count / 1e9:.2f} B parameters, {spec.dtype}) to {out}")
    return 0
