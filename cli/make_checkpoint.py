"""``switchyard make-checkpoint``: write a random-weight checkpoint in Hugging Face format."""

from __future__ import annotations

import argparse
import dataclasses

from switchyard.cli.usage import UsageError, writable_folder
from switchyard.service.modelspec import PRESETS, format_count, preset, preset_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help=f"model shape: {', '.join(PRESETS)}")
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the preset's dtype")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="split weights into files of about this size")


def run(args: argparse.Namespace) -> int:
    from switchyard.service.engine.checkpoint import write_checkpoint

    if preset_name(args.preset) is None:
        raise UsageError(f"--preset {args.preset!r} is not one of {', '.join(PRESETS)}")
    if not args.shard_gb > 0:
        raise UsageError(f"--shard-gb must be more than 0, got {args.shard_gb}")
    if args.seed < 0:
        raise UsageError(f"--seed must be zero or more, got {args.seed}")
    writable_folder(args.out, "--out")
    spec = preset(args.preset)
    if args.dtype:
        spec = dataclasses.replace(spec, dtype=args.dtype)
    out = write_checkpoint(spec, args.out, seed=args.seed, shard_bytes=int(args.shard_gb * (1 << 30)))
    print(f"wrote {spec.name} ({format_count(spec.param_count)} parameters, {spec.dtype}) to {out}")
    return 0
