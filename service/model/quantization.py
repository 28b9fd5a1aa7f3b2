"""FP8 checkpoint formats, as a Hugging Face ``config.json`` states them in ``quantization_config``.

Three formats are published for FP8 (e4m3) weights; each stores a layer matrix as its float8 tensor
``<module>.weight`` [out, in] and a float32 (or 16-bit) scale tensor beside it:

* compressed-tensors (``quant_method: compressed-tensors``, llm-compressor's FP8 / FP8-dynamic
  releases): ``weight_scale`` per tensor ([] or [1]), per output channel ([out, 1]) or per block
  ([ceil(out/bn), ceil(in/bk)], ``strategy: block``); activations quantized dynamically per token, or
  with a static per-tensor ``input_scale`` [] / [1];
* FBGEMM (``quant_method: fbgemm_fp8``, Meta's Llama-3.1-405B FP8): ``weight_scale`` per row
  [out, 1]; activations per token (``activation_scale_ub`` bounds their scale);
* block-wise (``quant_method: fp8`` with ``weight_block_size``, DeepSeek's and Qwen's FP8
  releases): ``weight_scale_inv`` [ceil(out/bn), ceil(in/bk)], multiplied in despite its name;
  without ``weight_block_size`` (AutoFP8's releases) ``weight_scale`` per tensor.

Modules left in the model's dtype (``ignore``, ``modules_to_not_convert``) are named by the
config and, for the loader, by the tensors' own dtype in the files, which decides.

JAX-free and NumPy-free: the planner prices a model's weights through this module.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

METHODS = ("compressed-tensors", "fbgemm_fp8", "fp8")
WEIGHT_STRATEGIES = ("tensor", "channel", "block")
# The layer matrices a format quantizes (engine roles, service/model/family.py); norms, biases, the
# embedding table and the LM head stay in the model's dtype.
MATRIX_ROLES = ("q", "k", "v", "o", "gate", "up", "down")
# Bytes of one stored scale as the engine holds it (float32 per output channel, or per channel and
# block of K).
SCALE_BYTES = 4
# What `serve --quantization` and the operator's spec.model.quantization accept: the checkpoint as it
# is, no quantization (an FP8 checkpoint dequantized to the model's dtype at load) or FP8 (a 16-bit
# checkpoint quantized at load with a scale per output channel; an FP8 checkpoint as it is).
CHOICES = ("auto", "none", "fp8")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class QuantizationConfigError(ValueError):
    """A ``quantization_config`` that describes no FP8 format served here."""


@dataclasses.dataclass(frozen=True)
class Quantization:
    """One FP8 weight format. ``weights``: the scale's granularity (``tensor``, ``channel`` or
    ``block`` of ``block`` = (out, in) elements); ``activations``: ``dynamic`` (per token at run
    time), ``static`` (a per-tensor ``input_scale`` in the files) or ``none`` (weight-only);
    ``ignore``: the config's patterns of modules kept in the model's dtype."""

    method: str
    weights: str
    block: tuple[int, int] | None = None
    activations: str = "dynamic"
    ignore: tuple[str, ...] = ()
    at_load: bool = False  # made at load from 16-bit tensors, not read from a checkpoint

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantizationConfigError(f"quant_method {self.method!r:.40} is not served (FP8 formats: "
                                          f"{', '.join(METHODS)})")
        if self.weights not in WEIGHT_STRATEGIES:
            raise QuantizationConfigError(f"weight scale strategy {self.weights!r:.40} is not served "
                                          f"({', '.join(WEIGHT_STRATEGIES)})")
        if (self.weights == "block") != (self.block is not None):
            raise QuantizationConfigError("block-wise weight scales need a block size, and only they take one")
        if self.block is not None and not (len(self.block) == 2 and all(_positive_int(b) for b in self.block)):
            raise QuantizationConfigError(f"the weight block size must be two positive integers, "
                                          f"got {self.block!r:.40}")

    # ---- names and shapes of the files' tensors --------------------------------------------------
    @property
    def scale_name(self) -> str:
        """The weight scale's tensor name beside ``<module>.weight``."""
        return "weight_scale_inv" if self.method == "fp8" and self.weights == "block" else "weight_scale"

    @property
    def block_k(self) -> int:
        """Input features per scale (0: one scale over all of them)."""
        return self.block[1] if self.block is not None else 0

    def scale_shapes(self, out: int, inp: int) -> tuple[tuple[int, ...], ...]:
        """The shapes the published files give the weight scale of an [out, in] matrix."""
        if self.weights == "tensor":
            return ((), (1,), (1, 1))
        if self.weights == "channel":
            return ((out, 1), (out,))
        assert self.block is not None
        return ((math.ceil(out / self.block[0]), math.ceil(inp / self.block[1])),)

    def ignores(self, module: str) -> bool:
        """Whether the config names ``module`` (e.g. ``model.layers.0.self_attn.q_proj``) as kept in
        the model's dtype: a pattern equal to it, one of its parents or its ending, or a ``re:``
        regular expression matching it."""
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.startswith(pattern.rstrip(".") + ".") or module.endswith("." + pattern):
                return True
        return False

    # ---- what it costs -----------------------------------------------------------------------------
    def matrix_bytes(self, out: int, inp: int) -> int:
        """Bytes of one quantized [out, in] matrix as the engine holds it: a byte per weight and a
        float32 scale per output channel (and per block of K)."""
        groups = math.ceil(inp / self.block[1]) if self.block is not None else 1
        return out * inp + out * groups * SCALE_BYTES

    # ---- for people and for config.json -------------------------------------------------------------
    @property
    def label(self) -> str:
        """E.g. ``fp8 e4m3 (compressed-tensors, per-channel weight scales, dynamic activation scales)``."""
        if self.at_load:
            return "fp8 e4m3 (quantized at load, per-channel weight scales, dynamic activation scales)"
        weights = {"tensor": "per-tensor", "channel": "per-channel",
                   "block": f"{self.block[0]}x{self.block[1]} block" if self.block else "block"}[self.weights]
        acts = {"dynamic": "dynamic activation scales", "static": "static activation scales",
                "none": "weight-only"}[self.activations]
        return f"fp8 e4m3 ({self.method}, {weights} weight scales, {acts})"

    def to_config(self) -> dict[str, Any]:
        """The ``quantization_config`` a checkpoint of this format carries (as the hub's do)."""
        if self.method == "fbgemm_fp8":
            return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                    "modules_to_not_convert": list(self.ignore) or ["lm_head"]}
        if self.method == "fp8":
            out: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3",
                                   "activation_scheme": "static" if self.activations == "static" else "dynamic"}
            if self.block is not None:
                out["weight_block_size"] = list(self.block)
            if self.ignore:
                out["modules_to_not_convert"] = list(self.ignore)
            return out
        weights: dict[str, Any] = {"num_bits": 8, "type": "float", "strategy": self.weights, "symmetric": True,
                                   "dynamic": False, "observer": "minmax"}
        if self.block is not None:
            weights["block_structure"] = list(self.block)
        acts = None
        if self.activations != "none":
            acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": self.activations == "dynamic",
                    "strategy": "token" if self.activations == "dynamic" else "tensor"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
                "ignore": list(self.ignore) or ["lm_head"], "kv_cache_scheme": None}


# The format a checkpoint quantized here takes (serve --quantization fp8, make-checkpoint): a scale
# per output channel, activations per token (compressed-tensors' FP8-dynamic layout).
PER_CHANNEL = Quantization("compressed-tensors", "channel", activations="dynamic", ignore=("lm_head",))
# A 16-bit checkpoint served with --quantization fp8: the layer matrices as the engine holds them
# after quantizing at load (a scale per output channel; the LM head stays 16-bit).
QUANTIZED_AT_LOAD = Quantization("compressed-tensors", "channel", activations="dynamic", ignore=("lm_head",),
                                 at_load=True)
# make-checkpoint's FP8 formats, each in a published layout.
WRITTEN: dict[str, Quantization] = {
    "fp8": PER_CHANNEL,
    "fp8-static": Quantization("compressed-tensors", "tensor", activations="static", ignore=("lm_head",)),
    "fp8-block": Quantization("fp8", "block", block=(128, 128), activations="dynamic"),
    "fbgemm-fp8": Quantization("fbgemm_fp8", "channel", activations="dynamic", ignore=("lm_head",)),
}


def _patterns(value: Any, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, Sequence) or isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise QuantizationConfigError(f"quantization_config.{field} must be a list of module names")
    return tuple(value)


def from_config(config: Mapping[str, Any]) -> Quantization | None:
    """The FP8 format of a config.json, or None when it states no quantization. One line naming the
    field for what is not an FP8 format served here."""
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise QuantizationConfigError("quantization_config must be an object")
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fbgemm_fp8":
        return Quantization("fbgemm_fp8", "channel", activations="dynamic",
                            ignore=_patterns(raw.get("modules_to_not_convert"), "modules_to_not_convert"))
    if method == "fp8":
        return _fp8(raw)
    raise QuantizationConfigError(f"quantization_config.quant_method {method!r:.40} is not served (FP8 formats: "
                                  f"{', '.join(METHODS)})")


def _fp8(raw: Mapping[str, Any]) -> Quantization:
    fmt = raw.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise QuantizationConfigError(f"quantization_config.fmt {fmt!r:.40} is not served (e4m3 only)")
    scheme = raw.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise QuantizationConfigError(f"quantization_config.activation_scheme must be dynamic or static, "
                                      f"got {scheme!r:.40}")
    ignore = _patterns(raw.get("modules_to_not_convert") or raw.get("ignored_layers"), "modules_to_not_convert")
    block = raw.get("weight_block_size")
    if block is None:
        return Quantization("fp8", "tensor", activations=scheme, ignore=ignore)
    if not isinstance(block, Sequence) or len(block) != 2 or not all(_positive_int(b) for b in block):
        raise QuantizationConfigError(f"quantization_config.weight_block_size must be two positive integers, "
                                      f"got {block!r:.40}")
    return Quantization("fp8", "block", block=(block[0], block[1]), activations=scheme, ignore=ignore)


def _compressed_tensors(raw: Mapping[str, Any]) -> Quantization:
    fmt = raw.get("format", "float-quantized")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise QuantizationConfigError(f"quantization_config.format {fmt!r:.40} is not served (FP8 e4m3 weights: "
                                      "float-quantized)")
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise QuantizationConfigError("quantization_config.config_groups must name at least one group")
    found: set[tuple[str, tuple[int, int] | None, str]] = set()
    for name, group in groups.items():
        where = f"quantization_config.config_groups.{name}"
        if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
            raise QuantizationConfigError(f"{where} has no weights scheme")
        weights = group["weights"]
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise QuantizationConfigError(f"{where}.weights is {weights.get('num_bits')!r:.10}-bit "
                                          f"{weights.get('type')!r:.10}: only 8-bit float (FP8) weights are served")
        strategy = weights.get("strategy", "tensor")
        if strategy not in WEIGHT_STRATEGIES:
            raise QuantizationConfigError(f"{where}.weights.strategy {strategy!r:.40} is not served "
                                          f"({', '.join(WEIGHT_STRATEGIES)})")
        block = None
        if strategy == "block":
            raw_block = weights.get("block_structure")
            if not isinstance(raw_block, Sequence) or len(raw_block) != 2 \
                    or not all(_positive_int(b) for b in raw_block):
                raise QuantizationConfigError(f"{where}.weights.block_structure must be two positive integers, "
                                              f"got {raw_block!r:.40}")
            block = (raw_block[0], raw_block[1])
        acts = group.get("input_activations")
        if acts is None:
            activations = "none"
        elif not isinstance(acts, Mapping) or acts.get("num_bits") != 8 or acts.get("type") != "float":
            raise QuantizationConfigError(f"{where}.input_activations must be 8-bit float (FP8) or null")
        else:
            activations = "dynamic" if acts.get("dynamic") else "static"
        found.add((strategy, block, activations))
    if len(found) > 1:
        raise QuantizationConfigError("quantization_config.config_groups give the layers different FP8 schemes, "
                                      "which is not served (one scheme for every layer)")
    strategy, block, activations = found.pop()
    return Quantization("compressed-tensors", strategy, block=block, activations=activations,
                        ignore=_patterns(raw.get("ignore"), "ignore"))
