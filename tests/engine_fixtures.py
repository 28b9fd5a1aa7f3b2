"""Shared tiny checkpoint and engines (compiling is the slow part of CPU tests, so engines are reused)."""

from __future__ import annotations

from pathlib import Path

from switchyard.service.checkpoint import write_checkpoint
from switchyard.service.engine import Engine
from switchyard.service.modelspec import ServingLayout, preset


def tiny_checkpoint(folder: Path) -> Path:
    return write_checkpoint(preset("tiny"), folder, seed=0, progress=False)


def tiny_engine(folder: Path, tp: int = 1, slots: int = 4, max_seq_len: int = 128) -> Engine:
    return Engine.from_checkpoint(folder, ServingLayout(tp=tp, batch_slots=slots, max_seq_len=max_seq_len),
                                  progress=False)


def varied_checkpoint(folder: Path, tokenizer_from: Path, seed: int = 11) -> Path:
    """A tiny checkpoint with larger random weights (transformers' own init, rescaled) whose greedy
    outputs vary from token to token, with the tiny tokenizer."""
    from hf_reference import hf_model, save_hf

    save_hf(hf_model(preset("tiny"), seed=seed), folder)
    (folder / "tokenizer.json").write_bytes((tokenizer_from / "tokenizer.json").read_bytes())
    return folder
