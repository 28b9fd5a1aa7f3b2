"""How each layer matrix of the parameter tree is held: dense in the model's dtype, or FP8 with its
scales (``switchyard.kernels.weights``). The tree's shapes and partition specs (``model.py``), the
loader (``checkpoint.py``) and the engine read a layer's formats from here, so the three trees a
load walks together (shapes, specs, fetchers) always match.

An FP8 matrix [in, out] is held as the checkpoints hold it, e4m3 [out, in], with float32 scales
[out, groups]; sharded as its dense form is (column-parallel matrices by output channel, row-parallel
ones by input feature), its scales with it: by output channel, and for block scales of a row-parallel
matrix by block of K (per-channel scales of a row-parallel matrix apply to every shard: replicated).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from jax.sharding import PartitionSpec as P
from switchyard.kernels.weights import DenseWeight, Fp8Weight

AXIS = "tp"
# The layer's matrices, and whether each is column-parallel (sharded by output channel) or
# row-parallel (by input feature).
MATRICES = ("wqkv", "wo", "wgu", "wdown")
COLUMN_PARALLEL = {"wqkv": True, "wo": False, "wgu": True, "wdown": False}


@dataclasses.dataclass(frozen=True)
class MatrixFormat:
    """Dense, or FP8 with a scale per output channel (``block_k`` 0) or per output channel and
    ``block_k`` input features."""

    fp8: bool = False
    block_k: int = 0

    @property
    def label(self) -> str:
        if not self.fp8:
            return "dense"
        return "fp8" if not self.block_k else f"fp8/{self.block_k}"


DENSE = MatrixFormat()
FP8_PER_CHANNEL = MatrixFormat(fp8=True)
LayerFormats = Mapping[str, MatrixFormat]


def uniform(num_layers: int, fmt: MatrixFormat) -> list[dict[str, MatrixFormat]]:
    """Every matrix of every layer in ``fmt``."""
    return [dict.fromkeys(MATRICES, fmt) for _ in range(num_layers)]


def matrix(fmt: MatrixFormat, dense: Any, w: Any, scale: Any) -> Any:
    """A matrix's leaf in a tree of shapes, specs or fetchers: ``dense`` as a dense weight, or ``w``
    and ``scale`` as an FP8 one."""
    if not fmt.fp8:
        return DenseWeight(dense)
    return Fp8Weight(w, scale, fmt.block_k)


def shape_leaf(name: str, fmt: MatrixFormat, in_out: tuple[int, int]) -> Any:
    """Matrix ``name`` [in, out] as a tree of global shapes."""
    k, n = in_out
    groups = 1 if not fmt.block_k else math.ceil(k / fmt.block_k)
    return matrix(fmt, (k, n), (n, k), (n, groups))


def spec_leaf(name: str, fmt: MatrixFormat) -> Any:
    """Matrix ``name`` as a tree of partition specs."""
    if COLUMN_PARALLEL[name]:
        return matrix(fmt, P(None, AXIS), P(AXIS, None), P(AXIS, None))
    return matrix(fmt, P(AXIS, None), P(None, AXIS), P(None, AXIS) if fmt.block_k else P(None, None))


def format_of(leaf: Any) -> MatrixFormat:
    """The format of a weight in a parameter tree."""
    if isinstance(leaf, Fp8Weight):
        return MatrixFormat(fp8=True, block_k=leaf.block_k)
    return DENSE


def formats_of(layers: Sequence[Mapping[str, Any]]) -> list[dict[str, MatrixFormat]]:
    """Each layer's matrix formats, from a parameter tree's ``layers``."""
    return [{name: format_of(layer[name]) for name in MATRICES} for layer in layers]


def summary(formats: Sequence[LayerFormats]) -> str:
    """The formats for people: ``dense``, ``fp8``, or the count of each kind when they differ."""
    counts: dict[str, int] = {}
    for layer in formats:
        for fmt in layer.values():
            counts[fmt.label] = counts.get(fmt.label, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{n} {label}" for label, n in sorted(counts.items()))


def fp8_matrices(formats: Sequence[LayerFormats]) -> int:
    return sum(fmt.fp8 for layer in formats for fmt in layer.values())

