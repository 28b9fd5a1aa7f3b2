"""A checkpoint's tensors by name, read lazily from its memory-mapped ``*.safetensors`` files.

Tensors are read from the file's own layout (an 8-byte header length, a JSON header of dtypes, shapes
and byte offsets, then the data) as a memory map viewed as the tensor's NumPy type: a slice reads only
its bytes, and copying it releases the GIL, so a load's reader threads copy side by side. safetensors'
NumPy reader copies under the GIL (about 1 GB/s however many threads read) and has no float8 type;
it serves only the dtypes :data:`RAW_DTYPES` lacks.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names read through a memory map, and their NumPy types.
RAW_DTYPES = {"F8_E4M3": ml_dtypes.float8_e4m3fn, "BF16": ml_dtypes.bfloat16, "F16": np.float16,
              "F32": np.float32}


class CheckpointError(ValueError):
    """A checkpoint folder that is missing files or tensors, or holds tensors of the wrong shape."""


class TensorSource:
    """Name -> lazily sliced tensor, across the files of one checkpoint (with or without an index)."""

    def __init__(self, folder: Path) -> None:
        index = folder / INDEX_FILE
        if index.exists():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            weight_map = {}
        if not files:
            raise CheckpointError(f"no *.safetensors files in {folder}")
        self._folder = folder
        self._handles = {}
        for name in files:
            path = folder / name
            if not path.exists():
                raise CheckpointError(f"{INDEX_FILE} names {name}, which is not in {folder}")
            self._handles[name] = safe_open(str(path), framework="numpy")
        if not weight_map:
            # safe_open handles are not mappings: keys() is their only listing.
            weight_map = {key: name for name, h in self._handles.items() for key in h.keys()}  # noqa: SIM118
        self._weight_map = weight_map
        self._headers: dict[str, tuple[dict[str, Any], int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def names(self) -> list[str]:
        return list(self._weight_map)

    def file_of(self, name: str) -> str:
        """The file (in the folder) that holds tensor ``name``."""
        return self._weight_map[name]

    def _tensor(self, name: str) -> Any:
        if name not in self._weight_map:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        return self._handles[self._weight_map[name]].get_slice(name)

    def dtype(self, name: str) -> str:
        """The tensor's safetensors dtype name (``BF16``, ``F32``, ``F8_E4M3``, ...)."""
        return str(self._tensor(name).get_dtype())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensor(name).get_shape())

    def slice(self, name: str, expected_shape: tuple[int, ...], index: Any = slice(None)) -> np.ndarray:
        tensor = self._tensor(name)
        shape = tuple(tensor.get_shape())
        if shape != expected_shape:
            raise CheckpointError(f"tensor {name} has shape {shape}, the config implies {expected_shape}")
        dtype = str(tensor.get_dtype())
        if dtype in RAW_DTYPES:
            data = self._raw(name, shape, RAW_DTYPES[dtype])
        elif not shape:  # safetensors' slices need a dimension
            data = self._handles[self._weight_map[name]].get_tensor(name)
        else:
            return tensor[index]
        # A scalar (AutoFP8's per-tensor scales) is read whole.
        return data[() if not shape and index == slice(None) else index]

    def _raw(self, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """The whole tensor as a read-only memory map (nothing is read until sliced)."""
        file = self._weight_map[name]
        if file not in self._headers:
            path = self._folder / file
            with path.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                self._headers[file] = (json.loads(f.read(length)), 8 + length)
        header, data_start = self._headers[file]
        begin, end = header[name]["data_offsets"]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * np.dtype(dtype).itemsize:
            raise CheckpointError(f"tensor {name} holds {end - begin} bytes, its shape {shape} needs "
                                  f"{count * np.dtype(dtype).itemsize}")
        if count == 0:
            return np.zeros(shape, dtype)
        raw = np.memmap(self._folder / file, dtype=np.uint8, mode="r", offset=data_start + begin, shape=(end - begin,))
        return raw.view(dtype).reshape(shape)
