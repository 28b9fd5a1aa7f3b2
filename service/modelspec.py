"""Model shape of a decoder of one of the supported families (``service.model``), read from a Hugging
Face ``config.json``.

Pure Python (no JAX, no NumPy): the operator's planner imports this module too.
Also holds :class:`ServingLayout`, the layout file the operator hands to each pod and
``switchyard serve`` reads, so both sides share one definition of it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from switchyard.kernels.selection import STRATEGIES  # JAX-free, as this module
from switchyard.service.model import FAMILIES, SUPPORTED_MODEL_TYPES, Family, FamilyConfigError, family_for_config
from switchyard.service.model import quantization as quant
from switchyard.service.model.family import tensor_shape
from switchyard.service.model.quantization import Quantization, QuantizationConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The KV cache's formats: the model's dtype, or e4m3 with a float32 scale per position and KV head
# (switchyard.kernels.kv_cache, which the engine sizes its pool by through this module).
KV_CACHE_DTYPES = ("auto", "fp8")
KV_FP8_SCALE_BYTES = 4
# Positions per block of the paged KV cache: pools are sized, and sequences take room, in whole blocks.
KV_BLOCK_TOKENS = 64
# Prompt tokens one step carries next to a token for each decoding sequence (chunked prefill).
DEFAULT_STEP_TOKENS = 256
# Prompt tokens a step carries when no sequence is decoding: nothing waits behind such a step, so its
# chunk is as long as the products run well at (a prompt alone goes through in fewer, larger steps).
IDLE_STEP_TOKENS = 2048
# Step token counts are multiples of this (the shapes the engine compiles stay few and aligned).
STEP_TOKENS_MULTIPLE = 16
# The share of the memory left after the weights a pool sized at start-up takes, by default and at most.
DEFAULT_KV_MEMORY_FRACTION = 0.9
MAX_KV_MEMORY_FRACTION = 0.95
# How long a later pipeline stage waits for stage 0's coordinator port to accept a connection before it
# gives up (exits, to be restarted). Long enough for a stage 0 started at the same time to import,
# check its model folder and open the port; short enough that a stage whose group cannot form exits in
# seconds instead of waiting out the distributed runtime's initialization timeout, a C++ abort.
DEFAULT_JOIN_TIMEOUT_S = 30.0
# How long the stages present wait for the whole pipeline group to form (stage 0 for the later stages'
# hellos, then every stage for the distributed runtime), after which each fails with one line.
GROUP_FORMATION_TIMEOUT_S = 300
# The share of a GPU's memory XLA's GPU compiler assumes its programs may use when the allocator states
# no limit (the virtual-memory allocator, which engine processes run, states none). A program whose
# parameters exceed it is scheduled against a limit of zero, with an ERROR line ("exceeds the base
# limit ... an error in the calculation") for every program compiled; the KV pool stays inside it.
XLA_UNSTATED_LIMIT_FRACTION = 0.8
# A step's parameters beside the weights and the KV pool (slot state, inputs and tokens) and a little
# room for its temporaries, inside that share.
STEP_PARAMETER_MARGIN = 256 << 20
# What the GPU runtime takes beside the weights (CUDA context, library workspaces, the kernels'
# buffers): the planner's ``runtime_reserve_bytes`` (operator/calibration.json; a test holds them equal).
RUNTIME_RESERVE_BYTES = 2 << 30


def compiler_room_bytes(gpu_bytes: int, weights_per_gpu: int, reserve: int = RUNTIME_RESERVE_BYTES) -> int:
    """What a KV pool may take on a GPU of ``gpu_bytes`` so that a step's parameters stay inside the
    :data:`XLA_UNSTATED_LIMIT_FRACTION` XLA's compiler assumes usable: that share less the weights,
    ``reserve`` and :data:`STEP_PARAMETER_MARGIN`; never below zero. The engine and the planner both
    size one-process pools by it."""
    return max(0, int(XLA_UNSTATED_LIMIT_FRACTION * gpu_bytes) - STEP_PARAMETER_MARGIN - weights_per_gpu - reserve)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

# Bounds of a model's shape, by config.json name: the largest models served, with room to spare
# (a vocabulary needs two tokens, RoPE pairs of dimensions, a sequence a prompt token and a generated
# one). The CRD's schema for spec.model.config states the same numbers; a test holds them equal.
INTEGER_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (2, 1 << 20),
    "hidden_size": (2, 1 << 17),
    "intermediate_size": (1, 1 << 20),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 4096),
    "max_position_embeddings": (2, 1 << 24),
    "rope_scaling.original_max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
}
# (exclusive lower bound, inclusive upper bound)
NUMBER_BOUNDS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),
    "rope_theta": (0.0, 1.0e12),
    "rope_scaling.factor": (0.0, 1024.0),
    "rope_scaling.low_freq_factor": (0.0, 1024.0),
    "rope_scaling.high_freq_factor": (0.0, 1024.0),
}
# ModelSpec field -> its config.json name, for the messages.
_CONFIG_NAMES = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
                 "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
                 "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
                 "max_position_embeddings": "max_position_embeddings", "rms_norm_eps": "rms_norm_eps",
                 "rope_theta": "rope_theta"}


def is_integer(value: Any) -> bool:
    """An int that is not a bool (a JSON ``true`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ModelSpecError(ValueError):
    """A config.json that does not describe a model this engine can run."""


def check_integer(name: str, value: Any) -> int:
    """``value`` of the config.json field ``name``, an integer within :data:`INTEGER_BOUNDS`."""
    low, high = INTEGER_BOUNDS[name]
    if not is_integer(value) or not low <= value <= high:
        raise ModelSpecError(f"{name} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


def check_number(name: str, value: Any) -> float:
    """``value`` of the config.json field ``name``, a finite number within :data:`NUMBER_BOUNDS`."""
    low, high = NUMBER_BOUNDS[name]
    if not is_number(value) or not low < value <= high:  # NaN fails both comparisons
        raise ModelSpecError(f"{name} must be a number in ({low:g}, {high:g}], got {value!r:.40}")
    return float(value)


def check_shape(spec: ModelSpec) -> None:
    """Every bound of a model's shape and every rule between its numbers, in one place: every way of
    making a ModelSpec (a config.json, a preset, the operator's spec) passes here, so the CLI, serve,
    the planner and the operator all refuse the same shapes with the same messages."""
    if spec.model_type not in FAMILIES:
        raise ModelSpecError(f"model_type {spec.model_type!r:.40} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for field, name in _CONFIG_NAMES.items():
        value = getattr(spec, field)
        if name in INTEGER_BOUNDS:
            check_integer(name, value)
        else:
            check_number(name, value)
    if spec.sliding_window is not None:
        check_integer("sliding_window", spec.sliding_window)
    if spec.num_heads % spec.num_kv_heads:
        raise ModelSpecError(
            f"num_attention_heads ({spec.num_heads}) must be a multiple of num_key_value_heads ({spec.num_kv_heads})")
    if spec.head_dim % 2:
        raise ModelSpecError(f"head_dim must be even for rotary embeddings, got {spec.head_dim}")
    if spec.dtype not in DTYPE_BYTES:
        raise ModelSpecError(f"torch_dtype must be one of {sorted(DTYPE_BYTES)}, got {spec.dtype!r:.40}")
    rope = spec.rope_scaling
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelSpecError(f"rope_scaling type {rope.rope_type!r:.40} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    for field in ("factor", "low_freq_factor", "high_freq_factor"):
        check_number(f"rope_scaling.{field}", getattr(rope, field))
    check_integer("rope_scaling.original_max_position_embeddings", rope.original_max_position_embeddings)
    if rope.rope_type == "llama3" and not rope.low_freq_factor < rope.high_freq_factor:
        raise ModelSpecError(f"rope_scaling.low_freq_factor ({rope.low_freq_factor:g}) must be below "
                             f"rope_scaling.high_freq_factor ({rope.high_freq_factor:g}): llama3 scaling blends "
                             "between the two")
    vocab = spec.vocab_size
    special = ([spec.bos_token_id] if spec.bos_token_id is not None else []) + list(spec.eos_token_ids)
    bad = [t for t in special if not is_integer(t) or not 0 <= t < vocab]
    if bad:
        raise ModelSpecError(f"bos_token_id / eos_token_id must be token ids in [0, {vocab}), got {bad[:4]!r:.60}")


def check_context(spec: ModelSpec, max_seq_len: int) -> None:
    """The rules between a model's shape and the context it is served with (known at serve time)."""
    window = spec.sliding_window
    if window is not None and window < max_seq_len:
        raise ModelSpecError(
            f"{spec.name} attends over a sliding window of {window} tokens, which the engine does not "
            f"implement: serve it with a context (max_seq_len) of at most {window}, not {max_seq_len}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def to_hf(self) -> dict[str, Any] | None:
        if self.rope_type == "default":
            return None
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"  # the family (service.model.FAMILIES)
    # Tokens a query attends back over (Mistral; Qwen's windowed layers); None: the whole sequence.
    sliding_window: int | None = None
    # The layer matrices' FP8 format (config.json's quantization_config); None: in ``dtype``.
    quantization: Quantization | None = None

    def __post_init__(self) -> None:
        check_shape(self)

    # ---- family --------------------------------------------------------------------------------
    @property
    def family(self) -> Family:
        return FAMILIES[self.model_type]

    @property
    def attention_bias(self) -> bool:
        """The q, k and v projections carry biases."""
        return self.family.attention_bias

    @property
    def qk_norm(self) -> bool:
        """Query and key heads are RMS-normed over head_dim before RoPE."""
        return self.family.qk_norm

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Every tensor of one layer, the family's extra ones (biases, q/k norms) included."""
        return self.family.layer_params(self)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def param_count(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + head + self.num_layers * self.layer_params + self.hidden_size

    @functools.cached_property
    def _quantized_matrices(self) -> tuple[int, int]:
        """(parameters, bytes) of the layer matrices held in FP8: those the format does not leave in
        the model's dtype."""
        q = self.quantization
        if q is None:
            return 0, 0
        params = stored = 0
        for i in range(self.num_layers):
            names = self.family.layer_names(i)
            for role in quant.MATRIX_ROLES:
                if q.ignores(names[role].removesuffix(".weight")):
                    continue
                out, inp = tensor_shape(role, self)
                params += out * inp
                stored += q.matrix_bytes(out, inp)
        return params, stored

    @property
    def param_bytes(self) -> int:
        """Bytes of every weight as served: in ``dtype``, the FP8 matrices at a byte each plus their scales."""
        params, stored = self._quantized_matrices
        return (self.param_count - params) * self.dtype_bytes + stored

    @property
    def weights_label(self) -> str:
        """The weights' format for people: ``bfloat16``, or the FP8 format's label."""
        return self.dtype if self.quantization is None else self.quantization.label

    def served_as(self, quantization: str) -> ModelSpec:
        """The model as a load with ``quantization`` holds it (``serve --quantization``, the operator's
        spec.model.quantization): ``auto`` as its checkpoint states, ``fp8`` its layer matrices in FP8
        (a 16-bit checkpoint quantized at load with a scale per output channel), ``none`` all in
        ``dtype`` (an FP8 checkpoint dequantized)."""
        if quantization not in quant.CHOICES:
            raise ModelSpecError(f"quantization must be one of {', '.join(quant.CHOICES)}, got {quantization!r:.40}")
        if quantization == "none":
            return dataclasses.replace(self, quantization=None)
        if quantization == "fp8" and self.quantization is None:
            return dataclasses.replace(self, quantization=quant.QUANTIZED_AT_LOAD)
        return self

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V cache one token occupies across all layers."""
        return self.kv_bytes_per_token_per_gpu(1, 1)

    def kv_bytes_per_token_per_gpu(self, tp: int, pp: int, dtype: str | None = None) -> int:
        """Bytes of K and V one token occupies on one GPU of a ``tp`` x ``pp`` layout: its share of the
        KV heads (``num_kv_heads / tp``) in its share of the layers (``num_layers / pp``), in ``dtype``
        (default: the model's; ``fp8``: a byte per element and a float32 scale per position and head)."""
        if not is_integer(tp) or not self.valid_tp(tp):
            raise ModelSpecError(f"tp must be a positive integer dividing the {self.num_heads} heads and "
                                 f"{self.num_kv_heads} KV heads, got {tp!r}")
        if not is_integer(pp) or pp <= 0 or self.num_layers % pp:
            raise ModelSpecError(f"pp must be a positive integer dividing the {self.num_layers} layers, got {pp!r}")
        dtype = self.dtype if dtype in (None, "auto") else dtype
        if dtype == "fp8":
            per_head = self.head_dim + KV_FP8_SCALE_BYTES
        elif dtype in DTYPE_BYTES:
            per_head = self.head_dim * DTYPE_BYTES[dtype]
        else:
            raise ModelSpecError(f"dtype must be one of {sorted(DTYPE_BYTES)} or fp8, got {dtype!r}")
        return 2 * (self.num_layers // pp) * (self.num_kv_heads // tp) * per_head

    def decode_bytes_per_step(self, batch: int, context: int, kv_dtype: str | None = None) -> int:
        """Bytes one decode step must read from HBM at the least: every weight a step uses once
        (the embedding table is gathered, so only ``batch`` rows of it) plus each sequence's KV (in
        ``kv_dtype``, default the model's)."""
        weights = self.param_bytes - self.embedding_params * self.dtype_bytes
        if self.tie_word_embeddings:
            weights += self.embedding_params * self.dtype_bytes  # the table doubles as the LM head
        embed_rows = batch * self.hidden_size * self.dtype_bytes
        return weights + embed_rows + batch * context * self.kv_bytes_per_token_per_gpu(1, 1, kv_dtype)

    def allreduce_bytes(self, batch: int) -> int:
        """Message size of one tensor-parallel all-reduce (the hidden state of the batch)."""
        return batch * self.hidden_size * self.dtype_bytes

    def valid_tp(self, tp: int) -> bool:
        return tp > 0 and self.num_heads % tp == 0 and self.num_kv_heads % tp == 0

    # ---- config.json -------------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
        if not isinstance(config, Mapping):
            raise ModelSpecError("config must be a JSON object")
        try:
            family = family_for_config(config)
            fields = family.read_config(config)
        except FamilyConfigError as err:
            raise ModelSpecError(str(err)) from None
        if config.get("hidden_act", "silu") != "silu":
            raise ModelSpecError(f"hidden_act {config['hidden_act']!r:.40} is not supported (every family "
                                 "served uses silu)")
        if config.get("mlp_bias"):
            raise ModelSpecError("mlp_bias is not supported: the MLP projections have no biases here")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in config]
        if missing:
            raise ModelSpecError(f"config.json lacks required fields: {', '.join(missing)}")
        heads = check_integer("num_attention_heads", config["num_attention_heads"])
        hidden = check_integer("hidden_size", config["hidden_size"])
        head_dim = config.get("head_dim")
        if head_dim is None:
            head_dim = fields.get("head_dim")  # a family's own default (Qwen3: 128)
        if head_dim is None:
            if hidden < heads:
                raise ModelSpecError(f"hidden_size ({hidden}) is smaller than num_attention_heads ({heads}): "
                                     "a head would have no dimensions (or give head_dim)")
            head_dim = hidden // heads
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        # transformers >= 5 writes rope settings as one `rope_parameters` object; older files use
        # top-level `rope_theta` plus `rope_scaling`.
        rope_params = config.get("rope_parameters")
        if isinstance(rope_params, Mapping):
            rope_theta = rope_params.get("rope_theta", config.get("rope_theta", 10000.0))
            scaling = rope_params if rope_params.get("rope_type", "default") != "default" else None
        else:
            rope_theta = config.get("rope_theta", 10000.0)
            scaling = config.get("rope_scaling")
        tie = config.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ModelSpecError(f"tie_word_embeddings must be true or false, got {tie!r:.40}")
        try:
            quantization = quant.from_config(config)
        except QuantizationConfigError as err:
            raise ModelSpecError(str(err)) from None
        return cls(
            name=name or config.get("_name_or_path") or config.get("name") or family.name,
            vocab_size=config["vocab_size"],
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=heads if config.get("num_key_value_heads") is None else config["num_key_value_heads"],
            head_dim=head_dim,
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            rms_norm_eps=check_number("rms_norm_eps", config.get("rms_norm_eps", 1e-5)),
            rope_theta=check_number("rope_theta", rope_theta),
            rope_scaling=_rope_scaling_from_config(scaling),
            tie_word_embeddings=tie,
            dtype=str(dtype),
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=family.name,
            sliding_window=fields.get("sliding_window"),
            quantization=quantization,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelSpec:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError as err:
            raise ModelSpecError(f"no config.json at {path}") from err
        except json.JSONDecodeError as err:
            raise ModelSpecError(f"{path} is not valid JSON: {err}") from err
        return cls.from_config(config, name=path.parent.name if path.name == "config.json" else None)

    def to_config(self) -> dict[str, Any]:
        """The config.json of this shape, as the family's Hugging Face config class reads it."""
        eos: int | list[int] | None
        eos = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        return {
            "architectures": [self.family.architectures[0]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling.to_hf(),
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos if self.eos_token_ids else None,
            **self.family.write_config(self),
            **({"quantization_config": self.quantization.to_config()} if self.quantization else {}),
        }


def _rope_scaling_from_config(raw: Any) -> RopeScaling:
    if raw is None:
        return RopeScaling()
    if not isinstance(raw, Mapping):
        raise ModelSpecError(f"rope_scaling must be an object or null, got {raw!r}")
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelSpecError(
            f"rope_scaling type {rope_type!r:.40} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    return RopeScaling(
        rope_type=rope_type,
        factor=check_number("rope_scaling.factor", raw.get("factor", 1.0)),
        low_freq_factor=check_number("rope_scaling.low_freq_factor", raw.get("low_freq_factor", 1.0)),
        high_freq_factor=check_number("rope_scaling.high_freq_factor", raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=check_integer(
            "rope_scaling.original_max_position_embeddings", raw.get("original_max_position_embeddings", 8192)),
    )


_LLAMA3_ROPE = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
_TINY_ROPE = RopeScaling("llama3", 4.0, 1.0, 4.0, 256)

PRESETS: dict[str, ModelSpec] = {
    # Small enough for CPU tests and the README demo; GQA 2:1 like the real family.
    "tiny": ModelSpec(name="tiny-llama", vocab_size=512, hidden_size=128, intermediate_size=352,
                      num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16,
                      max_position_embeddings=2048, rope_theta=10000.0, rope_scaling=_TINY_ROPE,
                      dtype="float32", bos_token_id=1, eos_token_ids=(2,)),
    "llama3-8b": ModelSpec(name="llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                           num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                           max_position_embeddings=8192, rope_theta=500000.0,
                           bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "llama3.1-8b": ModelSpec(name="llama3.1-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE,
                             bos_token_id=128000, eos_token_ids=(128001, 128008, 128009)),
    "llama3-70b": ModelSpec(name="llama3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                            num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=8192, rope_theta=500000.0,
                            bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "llama3.1-405b": ModelSpec(name="llama3.1-405b", vocab_size=128256, hidden_size=16384,
                               intermediate_size=53248, num_layers=126, num_heads=128, num_kv_heads=8,
                               head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                               rope_scaling=_LLAMA3_ROPE, bos_token_id=128000,
                               eos_token_ids=(128001, 128008, 128009)),
    # Tiny shapes of the other families (random-weight checkpoints, tests): Mistral with a window as
    # long as its context; Qwen2 with QKV biases, GQA 4:1 and tied embeddings; Qwen3 with q/k norms and
    # a head_dim that is not hidden_size / heads.
    "tiny-mistral": ModelSpec(name="tiny-mistral", vocab_size=512, hidden_size=128, intermediate_size=352,
                              num_layers=4, num_heads=8, num_kv_heads=4, head_dim=16,
                              max_position_embeddings=2048, rope_theta=1000000.0, dtype="float32",
                              bos_token_id=1, eos_token_ids=(2,), model_type="mistral", sliding_window=2048),
    "tiny-qwen2": ModelSpec(name="tiny-qwen2", vocab_size=512, hidden_size=128, intermediate_size=352,
                            num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16,
                            max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            tie_word_embeddings=True, dtype="float32", bos_token_id=1, eos_token_ids=(2,),
                            model_type="qwen2"),
    "tiny-qwen3": ModelSpec(name="tiny-qwen3", vocab_size=512, hidden_size=128, intermediate_size=352,
                            num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32,
                            max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            dtype="float32", bos_token_id=1, eos_token_ids=(2,), model_type="qwen3"),
    "mistral-7b": ModelSpec(name="mistral-7b", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=32768, rope_theta=1000000.0, bos_token_id=1,
                            eos_token_ids=(2,), model_type="mistral"),
    "qwen2.5-7b": ModelSpec(name="qwen2.5-7b", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                            max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
                            bos_token_id=151643, eos_token_ids=(151645, 151643), model_type="qwen2"),
    "qwen3-8b": ModelSpec(name="qwen3-8b", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                          num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                          max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          bos_token_id=151643, eos_token_ids=(151645, 151643), model_type="qwen3"),
}


# The names the model family itself uses (and our manifests' model names) for the same presets.
PRESET_ALIASES = {"llama-3-8b": "llama3-8b", "llama-3.1-8b": "llama3.1-8b", "llama-3-70b": "llama3-70b",
                  "llama-3.1-405b": "llama3.1-405b"}


def preset_name(name: str) -> str | None:
    """The preset ``name`` means (itself or through an alias), or None."""
    name = PRESET_ALIASES.get(name, name)
    return name if name in PRESETS else None


def preset(name: str) -> ModelSpec:
    found = preset_name(name)
    if found is None:
        raise ModelSpecError(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    return PRESETS[found]


def kv_tokens_for_memory(spec: ModelSpec, tp: int, pp: int, free_bytes_per_gpu: int | float,
                         dtype: str | None = None) -> int:
    """KV pool size in tokens whose K and V, for one GPU's share of a ``tp`` x ``pp`` layout, fit in
    ``free_bytes_per_gpu`` (the bytes that GPU gives the pool), in whole blocks of
    :data:`KV_BLOCK_TOKENS`. Every GPU of a replica holds the same positions, so this is the replica's
    pool too. No room (zero or negative bytes) is 0 tokens."""
    per_token = spec.kv_bytes_per_token_per_gpu(tp, pp, dtype)
    if isinstance(free_bytes_per_gpu, bool) or not isinstance(free_bytes_per_gpu, (int, float)) \
            or not math.isfinite(free_bytes_per_gpu):
        raise ModelSpecError(f"free_bytes_per_gpu must be a finite number of bytes, got {free_bytes_per_gpu!r}")
    if free_bytes_per_gpu <= 0:
        return 0
    blocks = int(free_bytes_per_gpu // (per_token * KV_BLOCK_TOKENS))
    return blocks * KV_BLOCK_TOKENS


def format_count(n: int) -> str:
    """1234 -> '1.23 thousand', 8_030_261_248 -> '8.03 billion': parameter counts of any size."""
    for scale, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if n >= scale:
            return f"{n / scale:.2f} {word}"
    return str(n)


# ---- the layout file the operator writes and `switchyard serve` reads ----------------------------


@dataclasses.dataclass(frozen=True)
class ServingLayout:
    """How one pod serves: its tensor-parallel size, collective strategy and KV budget.

    ``batch_slots`` is the sequences decoded at once (decode rows); ``kv_tokens`` the positions the
    pod's paged KV pool holds, shared by all of them (0: sized at start-up as ``kv_memory_fraction`` of
    the memory left after the weights); ``step_tokens`` the prompt tokens one step carries next to a
    token for each decoding sequence.

    Written by the operator as JSON into a ConfigMap; read by ``switchyard serve --layout``.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    strategy: str = "auto"
    batch_slots: int = 8
    max_seq_len: int = 2048
    model_name: str = ""
    model_path: str = ""
    pipeline_stage: int = 0
    coordinator: str = ""
    kv_tokens: int = 0
    kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION
    step_tokens: int = DEFAULT_STEP_TOKENS
    # The layer matrices' format (auto: the checkpoint's; fp8: quantized at load; none: dequantized)
    # and the KV cache's (auto: the model's dtype; fp8).
    quantization: str = "auto"
    kv_cache_dtype: str = "auto"
    join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S  # a later stage's wait for stage 0's coordinator port
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "dp", "batch_slots", "max_seq_len", "step_tokens"):
            value = getattr(self, field)
            if not is_integer(value) or value <= 0:
                raise ModelSpecError(f"layout.{field} must be a positive integer, got {value!r}")
        if self.step_tokens < STEP_TOKENS_MULTIPLE or self.step_tokens % STEP_TOKENS_MULTIPLE:
            raise ModelSpecError(f"layout.step_tokens must be a multiple of {STEP_TOKENS_MULTIPLE} and at least "
                                 f"{STEP_TOKENS_MULTIPLE}, got {self.step_tokens}")
        if not is_integer(self.kv_tokens) or self.kv_tokens < 0:
            raise ModelSpecError(f"layout.kv_tokens must be a whole number of tokens, 0 or more (0: size the "
                                 f"pool at start-up), got {self.kv_tokens!r}")
        if self.kv_tokens % KV_BLOCK_TOKENS:
            raise ModelSpecError(f"layout.kv_tokens must be a multiple of {KV_BLOCK_TOKENS} (positions per KV "
                                 f"block), got {self.kv_tokens}")
        if 0 < self.kv_tokens < self.max_seq_len:
            raise ModelSpecError(f"layout.kv_tokens ({self.kv_tokens}) must hold one full-length sequence: at "
                                 f"least layout.max_seq_len ({self.max_seq_len})")
        fraction = self.kv_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 < fraction <= MAX_KV_MEMORY_FRACTION:
            raise ModelSpecError(f"layout.kv_memory_fraction must be a number in (0, {MAX_KV_MEMORY_FRACTION}], "
                                 f"got {fraction!r}")
        timeout = self.join_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ModelSpecError(f"layout.join_timeout_s must be a positive number of seconds, got {timeout!r:.40}")
        if self.strategy not in STRATEGIES:
            raise ModelSpecError(f"layout.strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        if self.quantization not in quant.CHOICES:
            raise ModelSpecError(f"layout.quantization must be one of {', '.join(quant.CHOICES)}, "
                                 f"got {self.quantization!r:.40}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ModelSpecError(f"layout.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                 f"got {self.kv_cache_dtype!r:.40}")
        if not 0 <= self.pipeline_stage < self.pp:
            raise ModelSpecError(f"layout.pipeline_stage must be in [0, {self.pp}), got {self.pipeline_stage}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServingLayout:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as err:
            raise ModelSpecError(f"layout file is not valid JSON: {err}") from err
        if not isinstance(raw, dict):
            raise ModelSpecError("layout file must hold a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ModelSpecError(f"layout file has unknown fields: {', '.join(unknown)}")
        return cls(**raw)
