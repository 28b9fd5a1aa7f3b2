"""FP8 layer matrices of a checkpoint: which matrices a load holds in FP8 (``matrix_formats``), their
e4m3 values and scales read and checked from the published formats (``Fp8Matrices``) or made at load
from 16-bit tensors, and FP8 checkpoints written in the published layouts (``fp8_hf_tensors``,
``quantize_checkpoint``).

The formats are ``service/model/quantization.py``'s; a tensor is FP8 when the file says so (dtype
``F8_E4M3``), whatever the config's ignore lists say. Scales are checked as they are read: present,
shaped as the format publishes them, finite and not negative; a checkpoint that fails gets one line
naming the tensor, never a silent wrong answer.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from switchyard.kernels.fp8 import FP8_MAX, MIN_SCALE, NP_FP8, quantize_rows_np
from switchyard.service.engine import param_formats
from switchyard.service.engine.param_formats import COLUMN_PARALLEL, DENSE, FP8_PER_CHANNEL, MatrixFormat
from switchyard.service.engine.pipeline import check_stage_formats
from switchyard.service.engine.tensor_source import INDEX_FILE, CheckpointError, TensorSource
from switchyard.service.model.family import tensor_shape
from switchyard.service.model.quantization import CHOICES, MATRIX_ROLES, Quantization
from switchyard.service.modelspec import ModelSpec

FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F16")
# The engine's matrices and the Hugging Face tensors (roles) each is made of.
PARTS = {"wqkv": ("q", "k", "v"), "wo": ("o",), "wgu": ("gate", "up"), "wdown": ("down",)}


def _bounds(index: slice, n: int) -> tuple[int, int]:
    start, stop, step = index.indices(n)
    if step != 1:
        raise ValueError("strided slices of a matrix are not read")
    return start, stop


class Fp8Matrices:
    """The layer matrices of one checkpoint as FP8: each module's e4m3 weight and scales read from the
    files (checked), or for a 16-bit tensor quantized at load with a scale per output channel (each
    tensor once: the shards of a load read their rows of it)."""

    def __init__(self, src: TensorSource, spec: ModelSpec) -> None:
        self.src = src
        self.spec = spec
        self._scales: dict[str, np.ndarray] = {}
        self._quantized: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def is_fp8(self, name: str) -> bool:
        return name in self.src and self.src.dtype(name) == FP8_DTYPE

    @property
    def quantization(self) -> Quantization:
        q = self.spec.quantization
        if q is None:
            raise CheckpointError("the checkpoint holds float8 tensors, but its config.json states no "
                                  "quantization_config")
        return q

    def block_k(self) -> int:
        return self.quantization.block_k

    # ---- scales --------------------------------------------------------------------------------
    def scales(self, name: str, out: int, inp: int) -> np.ndarray:
        """The checked scales of FP8 tensor ``name`` [out, inp] as the engine holds them: float32 [out,
        groups], a per-tensor scale repeated over the output channels, block scales over each
        block's channels."""
        if name in self._scales:
            return self._scales[name]
        q = self.quantization
        module = name.removesuffix(".weight")
        scale_name = f"{module}.{q.scale_name}"
        if scale_name not in self.src:
            raise CheckpointError(f"{name} is float8 but the checkpoint has no {scale_name} ({q.method}, "
                                  f"{q.weights} scales)")
        values = self._checked(scale_name, q.scale_shapes(out, inp), f"{q.weights} scale of a [{out}, {inp}] matrix")
        if q.weights == "tensor":
            full = np.full((out, 1), values.reshape(-1)[0], np.float32)
        elif q.weights == "channel":
            full = values.reshape(out, 1)
        else:
            assert q.block is not None
            full = np.ascontiguousarray(np.repeat(values, q.block[0], axis=0)[:out])
        self._scales[name] = full
        return full

    def _checked(self, scale_name: str, shapes: Sequence[tuple[int, ...]], what: str) -> np.ndarray:
        dtype = self.src.dtype(scale_name)
        if dtype not in SCALE_DTYPES:
            raise CheckpointError(f"{scale_name} is {dtype}; scales are float32, bfloat16 or float16")
        shape = self.src.shape(scale_name)
        if shape not in shapes:
            raise CheckpointError(f"{scale_name} has shape {list(shape)}; the {what} has shape "
                                  + " or ".join(str(list(s)) for s in shapes))
        values = np.asarray(self.src.slice(scale_name, shape), dtype=np.float32)
        bad = ~np.isfinite(values) | (values < 0)
        if bad.any():
            at = tuple(int(i) for i in np.argwhere(bad)[0])
            raise CheckpointError(f"{scale_name} holds {values[at]} at {list(at)}: scales must be finite and "
                                  "not negative (the checkpoint is damaged)")
        return values

    def check_input_scale(self, name: str) -> None:
        """A static-activation format's per-tensor ``input_scale`` beside FP8 tensor ``name``: present,
        one value, finite, not negative. The engine quantizes activations per token at run time (at
        least as fine as one scale per tensor), so the value itself is not used."""
        scale_name = f"{name.removesuffix('.weight')}.input_scale"
        if scale_name not in self.src:
            raise CheckpointError(f"{name} is float8 with static activation scales, but the checkpoint has no "
                                  f"{scale_name}")
        self._checked(scale_name, ((), (1,), (1, 1)), "per-tensor input scale")

    # ---- values ----------------------------------------------------------------------------------
    def _quantize(self, name: str, out: int, inp: int) -> tuple[np.ndarray, np.ndarray]:
        """A 16-bit tensor quantized with a scale per output channel (cached for the next shard)."""
        if name not in self._quantized:
            if len(self._quantized) >= 4:  # a fused matrix's parts and no more: loads go matrix by matrix
                self._quantized.pop(next(iter(self._quantized)))
            self._quantized[name] = quantize_rows_np(self.src.slice(name, (out, inp)), axis=1)
        return self._quantized[name]

    def full_scales(self, name: str, out: int, inp: int) -> np.ndarray:
        """Tensor ``name``'s scales [out, groups] as the engine holds them: the file's, or made here."""
        return self.scales(name, out, inp) if self.is_fp8(name) else self._quantize(name, out, inp)[1]

    def part(self, name: str, out: int, inp: int, rows: slice, cols: slice) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows`` and input features ``cols`` of tensor ``name`` [out, inp] as e4m3 with their
        scales [rows, groups of cols]: the file's FP8, or quantized here."""
        if not self.is_fp8(name):
            q, scale = self._quantize(name, out, inp)
            return q[rows, cols], scale[rows]
        q = self.src.slice(name, (out, inp), (rows, cols))
        scale = self.scales(name, out, inp)[rows]
        bk = self.block_k()
        if bk:
            c0, c1 = _bounds(cols, inp)
            if c0 % bk:
                raise CheckpointError(f"{name}: a shard starting at input feature {c0} splits a {bk}-wide scale block")
            scale = scale[:, c0 // bk: math.ceil(c1 / bk)]
        return q, scale

    def dequantized(self, name: str, out: int, inp: int, index: tuple[slice, slice]) -> np.ndarray:
        """Rows and columns ``index`` of FP8 tensor ``name`` [out, inp] in float32 (each value times
        its scale), for a load that holds the matrix dense."""
        rows, cols = index
        q = self.src.slice(name, (out, inp), (rows, cols)).astype(np.float32)
        scale = self.scales(name, out, inp)[rows]
        bk = self.block_k()
        if bk:
            c0, c1 = _bounds(cols, inp)
            scale = scale[:, np.arange(c0, c1) // bk]
        return q * scale

    def read(self, name: str, expected: tuple[int, int], index: tuple[slice, slice]) -> np.ndarray:
        """Rows and columns ``index`` of a layer matrix [out, inp]: as stored when 16-bit, in float32
        when FP8."""
        if self.is_fp8(name):
            return self.dequantized(name, *expected, index)
        return self.src.slice(name, expected, index)


# ---- which matrices a load holds in FP8 ------------------------------------------------------------
def matrix_formats(matrices: Fp8Matrices, spec: ModelSpec, tp: int, choice: str) -> list[dict[str, MatrixFormat]]:
    """Each layer's matrix formats for a load at tensor-parallel size ``tp`` with ``choice``:
    ``auto`` as the files hold them, ``none`` every matrix dense (FP8 ones dequantized), ``fp8``
    every matrix FP8 (16-bit ones quantized with a scale per output channel). A fused matrix's
    parts must agree (one weight), and a block-scaled row-parallel matrix's shards must cut it on
    block boundaries."""
    if choice not in CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)}, got {choice!r}")
    out: list[dict[str, MatrixFormat]] = []
    any_fp8 = False
    for i in range(spec.num_layers):
        names = spec.family.layer_names(i)
        layer: dict[str, MatrixFormat] = {}
        for matrix, roles in PARTS.items():
            fp8 = [matrices.is_fp8(names[r]) for r in roles]
            if any(fp8) and not all(fp8):
                held = ", ".join(f"{names[r]} {'float8' if f else matrices.src.dtype(names[r])}"
                                 for r, f in zip(roles, fp8, strict=True))
                raise CheckpointError(f"layer {i} mixes FP8 and 16-bit tensors in one fused matrix ({held}); "
                                      "serve it with --quantization fp8 or none")
            in_file = all(fp8)
            any_fp8 = any_fp8 or in_file
            if in_file:
                bk = matrices.block_k()  # also checks that config.json states the format
                fmt = DENSE if choice == "none" else MatrixFormat(fp8=True, block_k=bk)
            else:
                fmt = FP8_PER_CHANNEL if choice == "fp8" else DENSE
            if fmt.block_k and not COLUMN_PARALLEL[matrix] and tp > 1:
                k = tensor_shape(roles[0], spec)[1]
                if (k // tp) % fmt.block_k:
                    raise CheckpointError(
                        f"{names[roles[0]]}: {k} input features over {tp} shards is {k // tp} a shard, not a whole "
                        f"number of {fmt.block_k}-wide scale blocks; serve it at another --tp or with "
                        "--quantization none")
            layer[matrix] = fmt
        out.append(layer)
    if spec.quantization is not None and not any_fp8 and choice == "auto":
        raise CheckpointError(f"config.json states FP8 quantization ({spec.quantization.method}) but no layer matrix "
                              "in the checkpoint is float8")
    return out


def check_checkpoint(folder: str | Path, spec: ModelSpec, tp: int = 1, choice: str = "auto", pp: int = 1) -> str:
    """Everything about a checkpoint's FP8 matrices that can be known before loading: the formats of
    a load with ``choice`` at ``tp`` over ``pp`` pipeline stages, and every FP8 tensor's scales (and
    static input scales) read and checked. Returns the formats' summary; raises CheckpointError (or
    ValueError: stages that would hold their layers unlike each other) with one line."""
    matrices = Fp8Matrices(TensorSource(Path(folder)), spec)
    formats = matrix_formats(matrices, spec, tp, choice)
    check_stage_formats(formats, pp)
    for i in range(spec.num_layers):
        names = spec.family.layer_names(i)
        for role in MATRIX_ROLES:
            name = names[role]
            if matrices.is_fp8(name):
                matrices.scales(name, *tensor_shape(role, spec))
                if matrices.quantization.activations == "static":
                    matrices.check_input_scale(name)
    return param_formats.summary(formats)


# ---- writing FP8 checkpoints in the published layouts ----------------------------------------------
def quantize_np(w: np.ndarray, q: Quantization) -> tuple[np.ndarray, np.ndarray]:
    """A 16-bit matrix [out, in] as e4m3 and its scales, shaped as format ``q`` publishes them."""
    wf = np.asarray(w, np.float32)
    if q.weights == "channel":
        return quantize_rows_np(wf, axis=1)
    if q.weights == "tensor":
        scale = np.float32(max(float(np.abs(wf).max()) / FP8_MAX, MIN_SCALE))
        return np.clip(wf / scale, -FP8_MAX, FP8_MAX).astype(NP_FP8), np.array([scale], np.float32)
    assert q.block is not None
    bn, bk = q.block
    out, inp = wf.shape
    ob, ib = math.ceil(out / bn), math.ceil(inp / bk)
    padded = np.zeros((ob * bn, ib * bk), np.float32)
    padded[:out, :inp] = np.abs(wf)
    amax = padded.reshape(ob, bn, ib, bk).max(axis=(1, 3))
    scale = np.maximum(amax / np.float32(FP8_MAX), np.float32(MIN_SCALE)).astype(np.float32)
    full = np.repeat(np.repeat(scale, bn, axis=0), bk, axis=1)[:out, :inp]
    return np.clip(wf / full, -FP8_MAX, FP8_MAX).astype(NP_FP8), scale


# The static activation scale a written checkpoint states (the engine quantizes activations per token
# and only checks it): the scale of activations up to 16 in magnitude.
WRITTEN_INPUT_SCALE = 16.0 / FP8_MAX


def fp8_hf_tensors(spec: ModelSpec, q: Quantization, tensors: Iterable[tuple[str, np.ndarray]]
                   ) -> Iterator[tuple[str, np.ndarray]]:
    """Hugging Face tensors with every layer matrix the format quantizes as its e4m3 weight and scale
    (and input scale, for static activations), named as the format's published checkpoints name them."""
    matrices = {names[role]: role for i in range(spec.num_layers)
                for names in [spec.family.layer_names(i)] for role in MATRIX_ROLES}
    for name, tensor in tensors:
        module = name.removesuffix(".weight")
        if name not in matrices or q.ignores(module):
            yield name, tensor
            continue
        weight, scale = quantize_np(tensor, q)
        yield name, weight
        yield f"{module}.{q.scale_name}", scale
        if q.activations == "static":
            yield f"{module}.input_scale", np.array([WRITTEN_INPUT_SCALE], np.float32)


def quantize_checkpoint(src: str | Path, out: str | Path, q: Quantization) -> Path:
    """A 16-bit checkpoint's copy in FP8 format ``q``: config.json with its quantization_config, every
    other file copied, each weights file rewritten under its own name with the matrices quantized."""
    src, out = Path(src), Path(out)
    spec = ModelSpec.from_file(src)
    if spec.quantization is not None:
        raise CheckpointError(f"{src} is already quantized ({spec.quantization.method})")
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = q.to_config()
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", INDEX_FILE) and f.suffix != ".safetensors":
            shutil.copy2(f, out / f.name)
    reader = TensorSource(src)
    weight_map: dict[str, str] = {}
    total = 0
    for file in sorted({p.name for p in src.glob("*.safetensors")}):
        names = [n for n in reader.names() if reader.file_of(n) == file]
        shard = dict(fp8_hf_tensors(spec, q, ((n, reader.slice(n, reader.shape(n))) for n in names)))
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.nbytes for t in shard.values())
    if (src / INDEX_FILE).exists():
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out
