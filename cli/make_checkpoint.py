"""``switchyard make-checkpoint``: write a random-weight checkpoint in Hugging Face format."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
from pathlib import Path

from switchyard.cli.usage import UsageError, writable_folder
from switchyard.service.modelspec import PRESETS, format_count, preset, preset_name
from switchyard.service.progress import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", required=True, help=f"model shape: {', '.join(PRESETS)}")
    parser.add_argument("--out", required=True, help="folder to write (created if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="override the preset's dtype")
    parser.add_argument("--shard-gb", type=float, default=4.0, help="split weights into files of about this size")


def free_bytes(folder: Path) -> int:
    """Free space where ``folder`` will be (its nearest existing parent's file system)."""
    existing = folder
    while not existing.exists():
        existing = existing.parent
    return shutil.disk_usage(existing).free


def run(args: argparse.Namespace) -> int:
    if preset_name(args.preset) is None:
        raise UsageError(f"--preset {args.preset!r} is not one of {', '.join(PRESETS)}")
    if not args.shard_gb > 0:
        raise UsageError(f"--shard-gb must be more than 0, got {args.shard_gb}")
    if args.seed < 0:
        raise UsageError(f"--seed must be zero or more, got {args.seed}")
    out = writable_folder(args.out, "--out").absolute()
    spec = preset(args.preset)
    if args.dtype:
        spec = dataclasses.replace(spec, dtype=args.dtype)
    # Said before the first byte: a real shape is gigabytes, and writing it takes minutes.
    size, free = spec.param_bytes, free_bytes(out)
    if size > free:
        raise UsageError(f"--out {str(out)!r}: {spec.name} needs {format_bytes(size)}, the disk has "
                         f"{format_bytes(free)} free")
    print(f"writing {spec.name} ({format_count(spec.param_count)} parameters, {spec.dtype}): "
          f"{format_bytes(size)} into {out}", flush=True)
    from switchyard.service.engine.checkpoint import write_checkpoint

    write_checkpoint(spec, out, seed=args.seed, shard_bytes=int(args.shard_gb * (1 << 30)))
    print(f"wrote {spec.name} ({format_count(spec.param_count)} parameters, {spec.dtype}) to {out}")
    return 0
