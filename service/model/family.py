"""What a model family states: the checkpoints it takes (``model_type`` / ``architectures``), what its
config.json adds to the shared shape, and the Hugging Face tensors each layer holds, so that the
loader finds them and the planner prices them.

JAX-free and NumPy-free: the operator reads families through ``service.modelspec``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from switchyard.service.modelspec import ModelSpec


class FamilyConfigError(ValueError):
    """A config.json that asks a family for something the engine does not implement."""


# Engine role -> the tensor's name under ``model.layers.{i}.`` (matrices are [out, in] there).
DECODER_LAYER = {
    "attn_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}
QKV_BIAS = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias", "v_bias": "self_attn.v_proj.bias"}
QK_NORM = {"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"}
# The tensors outside the layers.
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


def tensor_shape(role: str, spec: ModelSpec) -> tuple[int, ...]:
    """The Hugging Face shape of a layer tensor of ``role``."""
    h, q, kv, inter, d = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim
    shapes = {"attn_norm": (h,), "mlp_norm": (h,), "q": (q, h), "k": (kv, h), "v": (kv, h), "o": (h, q),
              "gate": (inter, h), "up": (inter, h), "down": (h, inter),
              "q_bias": (q,), "k_bias": (kv,), "v_bias": (kv,), "q_norm": (d,), "k_norm": (d,)}
    return shapes[role]


@dataclasses.dataclass(frozen=True)
class Family:
    """One decoder family. ``read_config`` maps its config.json to the ModelSpec fields it sets beyond
    the shared ones (``head_dim`` when absent, ``sliding_window``), raising :class:`FamilyConfigError`
    for what the engine does not implement; ``write_config`` is the inverse, the family's own keys of
    the config.json a random-weight checkpoint gets."""

    name: str  # the model_type a ModelSpec of this family carries
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]  # the first is written into config.json
    layer_tensors: Mapping[str, str]  # engine role -> name under model.layers.{i}.
    read_config: Callable[[Mapping[str, Any]], dict[str, Any]]
    write_config: Callable[[ModelSpec], dict[str, Any]]

    @property
    def attention_bias(self) -> bool:
        """The q, k and v projections carry biases (Qwen2)."""
        return "q_bias" in self.layer_tensors

    @property
    def qk_norm(self) -> bool:
        """Each query and key head is RMS-normed over head_dim before RoPE (Qwen3)."""
        return "q_norm" in self.layer_tensors

    def layer_names(self, i: int) -> dict[str, str]:
        return {role: f"model.layers.{i}.{name}" for role, name in self.layer_tensors.items()}

    def layer_shapes(self, spec: ModelSpec) -> dict[str, tuple[int, ...]]:
        return {role: tensor_shape(role, spec) for role in self.layer_tensors}

    def layer_params(self, spec: ModelSpec) -> int:
        """Parameters of one layer: every tensor it holds, the family's extra ones included."""
        return sum(math.prod(shape) for shape in self.layer_shapes(spec).values())

    def extra_layer_params(self, spec: ModelSpec) -> int:
        """Parameters one layer holds beyond the Llama decoder layer (biases, q/k norms)."""
        return sum(math.prod(tensor_shape(role, spec)) for role in self.layer_tensors if role not in DECODER_LAYER)


def refuse(config: Mapping[str, Any], key: str, family: str, why: str) -> None:
    """One clear line for a feature the family's config turns on and the engine does not implement."""
    if config.get(key):
        raise FamilyConfigError(f"{key} is not supported for {family}: {why}")


def windowed_layers(config: Mapping[str, Any]) -> int | None:
    """Qwen2 / Qwen3: the sliding window some layers apply, or None. Transformers applies the window
    only with ``use_sliding_window``, to the layers ``layer_types`` marks (by default those from
    ``max_window_layers`` on)."""
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is not True or window is None:
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        return window if "sliding_attention" in layer_types else None
    first, layers = config.get("max_window_layers", 28), config.get("num_hidden_layers")
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise FamilyConfigError(f"max_window_layers must be a whole number of layers, got {first!r:.40}")
    return window if not isinstance(layers, int) or first < layers else None
