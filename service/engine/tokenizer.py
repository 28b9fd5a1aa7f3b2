"""Tokenizers: loading a checkpoint's ``tokenizer.json`` and building a small one for random checkpoints."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from switchyard.service.modelspec import ModelSpec
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

BOS_TEXT = "<|begin_of_text|>"
EOS_TEXT = "<|end_of_text|>"
EOT_TEXT = "<|eot_id|>"

# Training text for the small byte-level BPE of random-weight checkpoints: plain English about the
# product's own domain, so common words become single tokens.
_CORPUS = """\
A decode service turns a prompt into tokens, one step at a time. Every step reads the weights of the
model once from memory, so the time per token is set by how many bytes move and how fast the memory
moves them. Tensor parallelism splits each layer across the GPUs of one node, and two all-reduce
operations per layer join the partial results. When the messages are small, the time of each
all-reduce is mostly latency, not bandwidth, and a one-shot kernel that reads every peer directly
over NVLink beats a ring. Continuous batching lets requests join and leave the batch between steps,
so the GPUs stay busy while each user sees tokens as soon as they are made. The operator reads the
nodes of the cluster, chooses how to split the model, explains why, and creates the pods. Once upon a
time there was a small model that wanted to speak. It learned the names of numbers: one, two, three,
four, five, six, seven, eight, nine, ten. It learned the colours of the sky and the sea, the sound of
rain on the roof, and the quiet of the night. The quick brown fox jumps over the lazy dog. Hello,
world! How are you today? I am fine, thank you. What time is it? It is time to generate text.
"""


def build_tokenizer(spec: ModelSpec, max_learned: int = 2048) -> HFTokenizer:
    """A byte-level BPE whose ids cover exactly ``spec.vocab_size``, with the spec's BOS/EOS ids."""
    specials: dict[int, str] = {}
    if spec.bos_token_id is not None:
        specials[spec.bos_token_id] = BOS_TEXT
    for n, eos in enumerate(spec.eos_token_ids):
        specials[eos] = EOS_TEXT if n == 0 else (EOT_TEXT if n == 1 else f"<|eos_{n}|>")
    if any(i >= spec.vocab_size for i in specials):
        raise ValueError("special token ids must be below vocab_size")
    learned_target = min(spec.vocab_size - len(specials), max_learned)
    trainer = trainers.BpeTrainer(vocab_size=learned_target, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    scratch = HFTokenizer(models.BPE())
    scratch.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    scratch.train_from_iterator([_CORPUS], trainer=trainer)
    learned = json.loads(scratch.to_str())["model"]
    learned_vocab: dict[str, int] = learned["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]

    # Learned tokens take the lowest free ids; the rest of the id space is reserved filler, as in Llama 3.
    free_ids = (i for i in range(spec.vocab_size) if i not in specials)
    vocab: dict[str, int] = {}
    for token, _ in sorted(learned_vocab.items(), key=lambda kv: kv[1]):
        vocab[token] = next(free_ids)
    vocab.update({text: i for i, text in specials.items()})
    for n, i in enumerate(free_ids):
        vocab[f"<|reserved_{n}|>"] = i

    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(text, special=True) for text in specials.values()])
    if spec.bos_token_id is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TEXT} $A", pair=f"{BOS_TEXT} $A {BOS_TEXT} $B",
            special_tokens=[(BOS_TEXT, spec.bos_token_id)])
    return tok


class Tokenizer:
    """The service's view of a tokenizer: ids in, text out, with the model's end-of-sequence ids."""

    def __init__(self, tokenizer: HFTokenizer, eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size

    @classmethod
    def from_dir(cls, path: str | Path, spec: ModelSpec | None = None) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.exists():
            raise FileNotFoundError(f"no tokenizer.json in {path}")
        spec = spec or ModelSpec.from_file(path)
        return cls(HFTokenizer.from_file(str(file)), spec.eos_token_ids, spec.vocab_size)

    def encode(self, text: str, max_tokens: int | None = None, *, special: bool = True) -> list[int]:
        """The ids of ``text``; TooManyTokens when there are more than ``max_tokens``. ``special``
        false: no BOS added (a chat template's text states its own special tokens).

        Through the library's batch call, which releases the GIL while it works (its plain ``encode``
        holds it throughout: a megabyte of text would stop every other thread of the process for most
        of a second), and counted before the ids become a Python list (which holds the GIL too)."""
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=special)
        if max_tokens is not None and len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding))
        return encoding.ids

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """The most bytes of text one token can stand for, where the tokenizer's pipeline never drops
        text before its model sees it (so a text of N bytes has at least N / this many tokens); None
        where it might (a normalizer, or a pre-tokenizer that removes what it splits on)."""
        return max_token_bytes(json.loads(self._tok.to_str()))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def incremental(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


class TooManyTokens(ValueError):
    """A text with more tokens than asked for; ``count`` is how many it has."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} tokens")
        self.count = count


# Pre-tokenizers that only cut text into pieces or map its bytes, never dropping any of it; Split keeps
# what it splits on unless its behaviour is "Removed".
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
_KEEPING_SPLITS = {"Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"}


def max_token_bytes(config: dict[str, Any]) -> int | None:
    """:attr:`Tokenizer.max_token_bytes` from a ``tokenizer.json``'s contents. A token's string in the
    vocabulary is never shorter, in UTF-8 bytes, than the text it stands for (byte-level alphabets,
    metaspace and byte-fallback pieces all take at least one byte per byte of text)."""
    if config.get("normalizer") is not None or not _keeps_text(config.get("pre_tokenizer")):
        return None
    vocab = config.get("model", {}).get("vocab") or {}
    pieces = vocab.keys() if isinstance(vocab, dict) else (entry[0] for entry in vocab)  # BPE / Unigram
    added = (token.get("content", "") for token in config.get("added_tokens") or [])
    return max((len(piece.encode("utf-8")) for piece in (*pieces, *added)), default=None) or None


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    if kind == "Split":
        return pre_tokenizer.get("behavior") in _KEEPING_SPLITS
    return kind in _KEEPING_PRE_TOKENIZERS


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas that never split a UTF-8 character.

    Decodes a short window of recent tokens and emits what is new once it no longer ends in an
    incomplete byte sequence (which byte-level decoding renders as U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read])
        new_text = self._tok.decode(self.ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end stays as U+FFFD)."""
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read])
        new_text = self._tok.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return new_text[len(prefix_text) :]
