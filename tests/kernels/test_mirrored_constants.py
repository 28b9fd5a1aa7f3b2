"""Constants that the CUDA sources and the Python side both define must agree: this reads the
``constexpr`` definitions of ``kernels/csrc`` and compares them with the Python values, so that
neither side can change alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from switchyard.kernels import attention, build, collectives, native

KERNELS = Path(build.__file__).resolve().parent
# A namespace-scope integer definition: `constexpr <integer type> kName = <expression>;` at the start
# of a line (floats and constants local to a function are not mirrored).
CONSTEXPR = re.compile(r"^constexpr\s+(?:int|int64_t|uint32_t|unsigned char|size_t)\s+(k\w+)\s*=\s*([^;]+);",
                       re.MULTILINE)
# The only syntax the mirrored constants use: integers, other constants, + - * / << and parentheses.
EXPRESSION = re.compile(r"^[\w\s()+\-*/<>]+$")


def csrc_constants() -> dict[str, int]:
    """Every integer constexpr of kernels/csrc (name -> value); names are unique across the files."""
    raw: dict[str, str] = {}
    for source in sorted(build.CSRC.glob("*.cu*")):
        for name, expr in CONSTEXPR.findall(source.read_text()):
            assert name not in raw, f"{name} is defined twice in kernels/csrc"
            raw[name] = expr.strip()
    values: dict[str, int] = {}

    def value(name: str) -> int:
        if name not in values:
            expr = re.sub(r"\b(0[xX][0-9a-fA-F]+|\d+)[uU]?[lL]*\b", r"\1", raw[name])
            if not EXPRESSION.match(expr):
                raise ValueError(f"{name} = {raw[name]}: not a constant integer expression")
            expr = re.sub(r"\bk\w+\b", lambda m: str(value(m.group(0))), expr)
            values[name] = int(eval(expr, {"__builtins__": {}}))  # digits and operators only
        return values[name]

    return {name: value(name) for name in raw}


# C++ constant -> the Python value that mirrors it.
MIRRORS = {
    "kMaxPartials": collectives.MAX_PARTIALS,
    "kAttnMaxSplits": attention.MAX_SPLITS,
    "kAttnMaxGroup": max(attention.KERNEL_GROUPS),
    "kPagedRowLimit": attention.POOL_ROW_LIMIT,
    "kPhaseSlots": native.PHASE_SLOTS,
    "kPhaseBlocks": native.PHASE_BLOCKS,
}


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_python_mirrors_the_cuda_constant(name: str) -> None:
    assert csrc_constants()[name] == MIRRORS[name]


def test_every_mirror_named_in_python_is_checked() -> None:
    """A Python constant whose comment names a csrc constant (``# kName in csrc/...``) is in MIRRORS."""
    named = set()
    for module in sorted(KERNELS.glob("*.py")):
        named |= set(re.findall(r"#.*?\b(k[A-Z]\w+)\b.*csrc/", module.read_text()))
    assert named, "no mirrored constant found: the comment convention changed"
    assert named <= set(MIRRORS), sorted(named - set(MIRRORS))
    assert set(MIRRORS) <= set(csrc_constants())


def test_the_parser_reads_expressions_and_types() -> None:
    consts = csrc_constants()
    assert consts["kTwoshotMaxBlocks"] == consts["kMaxBlocks"]  # defined through another constant
    assert consts["kEmptyWord"] == 0xFFFFFFFF and consts["kErrTimeout"] == 1  # uint32_t, u suffix
    assert "kAttnFloor" not in consts and "kWarps" not in consts  # a float; a function's own constant
