"""Hugging Face checkpoints: load straight into the sharded layout, and write random-weight ones.

Loading reads each device's slice of each tensor from the memory-mapped ``*.safetensors`` files and
places it on that device, so no device (and no host buffer) ever holds the whole model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.numpy import save_file
from switchyard.kernels.weights import DenseWeight
from switchyard.service.engine.model import ShardShape, is_shape, param_shapes, param_specs, stage_stacked
from switchyard.service.model.family import EMBED, FINAL_NORM, LM_HEAD, tensor_shape
from switchyard.service.modelspec import ModelSpec
from switchyard.service.progress import NoProgress, Progress, progress_bytes

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
INDEX_FILE = "model.safetensors.index.json"


def progress_bar(show: bool, total: int, desc: str) -> Progress:
    """Progress over ``total`` bytes: a bar on a terminal, a line every few seconds in a log
    (``service.progress``), or nothing. No disabled tqdm when nothing shows: it still makes a
    multiprocessing lock, which an engine process that is killed (or exits at once) leaves behind, and
    the resource tracker then warns of a leaked semaphore when serve exits."""
    return progress_bytes(total, desc) if show else NoProgress()


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

    def __contains__(self, name: str) -> bool:
        return name in self._weight_map

    def slice(self, name: str, expected_shape: tuple[int, ...], index: Any = slice(None)) -> np.ndarray:
        if name not in self._weight_map:
            raise CheckpointError(f"checkpoint has no tensor {name!r}")
        tensor = self._handles[self._weight_map[name]].get_slice(name)
        shape = tuple(tensor.get_shape())
        if shape != expected_shape:
            raise CheckpointError(f"tensor {name} has shape {shape}, the config implies {expected_shape}")
        return tensor[index]


def _shard_index(index: tuple[slice, ...], dim: int, width: int) -> int:
    start = index[dim].start or 0
    return start // width


def load_params(
    folder: str | Path, spec: ModelSpec, mesh: Mesh, dtype: str, progress: bool = True, stages: int = 1
) -> dict:
    """Read a Hugging Face checkpoint of the spec's family (its tensor names: ``service/model``) into
    the engine's sharded parameter tree on ``mesh``.

    With ``stages`` > 1 (a pipeline; the mesh has axes ``pp`` and ``tp``) each layer array gets a
    leading stage dimension sharded over ``pp``: entry j of ``layers`` holds, on stage s, layer
    ``s * layers_per_stage + j``; the LM head's vocabulary is split over every device of the mesh.
    """
    folder = Path(folder)
    src = TensorSource(folder)
    tp = mesh.shape["tp"]
    shape = ShardShape(spec, tp, vocab_shards=tp * stages)
    np_dtype = NP_DTYPES[dtype]
    s, hd = spec, spec.head_dim
    shapes, specs = param_shapes(shape), param_specs(spec)
    if s.num_layers % stages:
        raise ValueError(f"{stages} pipeline stages must divide the {s.num_layers} layers of {s.name}")
    per_stage = s.num_layers // stages

    def put(global_shape: tuple[int, ...], pspec, fetch: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
        sharding = NamedSharding(mesh, pspec)
        return jax.make_array_from_callback(global_shape, sharding, lambda idx: fetch(idx).astype(np_dtype))

    def whole(name: str, expected: tuple[int, ...]) -> Callable[[tuple[slice, ...]], np.ndarray]:
        return lambda idx: src.slice(name, expected)[idx]

    def column_block(parts: list[tuple[str, int, int]], width: int) -> Callable[[tuple[slice, ...]], np.ndarray]:
        """Shard r's columns = concat of rows [r*n, (r+1)*n) of each HF [out, in] tensor, transposed."""
        def fetch(idx: tuple[slice, ...]) -> np.ndarray:
            r = _shard_index(idx, 1, width)
            blocks = [src.slice(name, (out, s.hidden_size), slice(r * n, (r + 1) * n)).T for name, out, n in parts]
            return np.concatenate(blocks, axis=1)[idx[0]]
        return fetch

    def vector_block(parts: list[tuple[str, int, int]], width: int) -> Callable[[tuple[slice, ...]], np.ndarray]:
        """Shard r's entries = concat of entries [r*n, (r+1)*n) of each HF [out] vector (biases)."""
        def fetch(idx: tuple[slice, ...]) -> np.ndarray:
            r = _shard_index(idx, 0, width)
            return np.concatenate([src.slice(name, (out,), slice(r * n, (r + 1) * n)) for name, out, n in parts])
        return fetch

    def row_block(name: str, expected: tuple[int, ...]) -> Callable[[tuple[slice, ...]], np.ndarray]:
        """HF [out, in] tensor used as [in, out], sharded by its input rows (= the tensor's columns)."""
        def fetch(idx: tuple[slice, ...]) -> np.ndarray:
            return np.ascontiguousarray(src.slice(name, expected, (slice(None), idx[0])).T)[:, idx[1]]
        return fetch

    q_l, kv_l = shape.q_heads * hd, shape.kv_heads * hd

    def layer_fetchers(i: int) -> dict[str, Any]:
        """Layer i's tree of fetchers, shaped as its parameters (a weight holds its matrix's)."""
        n = s.family.layer_names(i)
        fetchers: dict[str, Any] = {
            "attn_norm": whole(n["attn_norm"], (s.hidden_size,)),
            "mlp_norm": whole(n["mlp_norm"], (s.hidden_size,)),
            "wqkv": DenseWeight(column_block(
                [(n["q"], s.q_size, q_l), (n["k"], s.kv_size, kv_l), (n["v"], s.kv_size, kv_l)], shape.qkv_cols)),
            "wo": DenseWeight(row_block(n["o"], (s.hidden_size, s.q_size))),
            "wgu": DenseWeight(column_block(
                [(n["gate"], s.intermediate_size, shape.inter), (n["up"], s.intermediate_size, shape.inter)],
                2 * shape.inter)),
            "wdown": DenseWeight(row_block(n["down"], (s.hidden_size, s.intermediate_size))),
        }
        if s.attention_bias:
            fetchers["bqkv"] = vector_block(
                [(n["q_bias"], s.q_size, q_l), (n["k_bias"], s.kv_size, kv_l), (n["v_bias"], s.kv_size, kv_l)],
                shape.qkv_cols)
        if s.qk_norm:
            fetchers["q_norm"] = whole(n["q_norm"], tensor_shape("q_norm", s))
            fetchers["k_norm"] = whole(n["k_norm"], tensor_shape("k_norm", s))
        return fetchers

    def stage_fetch(j: int, leaf: int) -> Callable[[tuple[slice, ...]], np.ndarray]:
        """Leaf ``leaf`` of entry j of the stage-stacked layers: stage s's block is layer s * per_stage + j."""
        def fetch(idx: tuple[slice, ...]) -> np.ndarray:
            stage = idx[0].start or 0
            return jax.tree.leaves(layer_fetchers(stage * per_stage + j))[leaf](idx[1:])[None]
        return fetch

    rep = P()
    itemsize = np.dtype(np_dtype).itemsize
    layer_bytes = itemsize * stages * sum(
        int(np.prod(dims)) for dims in jax.tree.leaves(shapes["layers"][0], is_leaf=is_shape))
    total = per_stage * layer_bytes + itemsize * sum(
        int(np.prod(shapes[name])) for name in ("embed", "final_norm", "lm_head"))
    bar = progress_bar(progress, total=total, desc=f"loading {folder.name}")
    params: dict[str, Any] = {"layers": []}
    params["embed"] = put(shapes["embed"], rep, whole(EMBED, (s.vocab_size, s.hidden_size)))
    bar.update(params["embed"].nbytes)
    for j in range(per_stage):
        lshape, lspec = shapes["layers"][j], specs["layers"][j]
        if stages == 1:
            fetchers = layer_fetchers(j)
            layer = {name: jax.tree.map(put, lshape[name], lspec[name], fetchers[name], is_leaf=is_shape)
                     for name in lshape}
        else:
            lshape, lspec = stage_stacked(lshape, lspec, stages, "pp")
            leaves, treedef = jax.tree.flatten(lshape, is_leaf=is_shape)
            layer = jax.tree.unflatten(treedef, [put(shp, ps, stage_fetch(j, k)) for k, (shp, ps) in enumerate(
                zip(leaves, jax.tree.leaves(lspec), strict=True))])
        params["layers"].append(layer)
        bar.update(sum(leaf.nbytes for leaf in jax.tree.leaves(layer)))
    params["final_norm"] = put(shapes["final_norm"], rep, whole(FINAL_NORM, (s.hidden_size,)))
    bar.update(params["final_norm"].nbytes)
    head_name = EMBED if s.tie_word_embeddings else LM_HEAD
    if not s.tie_word_embeddings and head_name not in src:
        raise CheckpointError("checkpoint has no lm_head.weight and the config does not tie word embeddings")
    local_vocab = shape.padded_vocab // (tp * stages)

    def head(idx: tuple[slice, ...]) -> np.ndarray:
        r = _shard_index(idx, 1, local_vocab)
        lo, hi = r * local_vocab, min((r + 1) * local_vocab, s.vocab_size)
        block = np.zeros((s.hidden_size, local_vocab), dtype=np.float32)
        if hi > lo:
            block[:, : hi - lo] = src.slice(head_name, (s.vocab_size, s.hidden_size), slice(lo, hi)).T
        return block[idx[0]]

    head_spec = specs["lm_head"] if stages == 1 else P(None, ("pp", "tp"))
    params["lm_head"] = put(shapes["lm_head"], head_spec, head)
    bar.update(params["lm_head"].nbytes)
    bar.close()
    return params


# ---- random-weight checkpoints -------------------------------------------------------------------
def random_hf_tensors(spec: ModelSpec, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """Hugging Face-named random tensors, one at a time, scaled like a trained model's (std 0.02)."""
    rng = np.random.default_rng(seed)
    s = spec
    dtype = NP_DTYPES[s.dtype]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    def norm(*shape: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    yield EMBED, normal(s.vocab_size, s.hidden_size)
    for i in range(s.num_layers):
        names, shapes = s.family.layer_names(i), s.family.layer_shapes(s)
        for role, name in names.items():  # the family's tensors: biases and q/k norms too
            yield name, (norm if role.endswith("norm") else normal)(*shapes[role])
    yield FINAL_NORM, norm(s.hidden_size)
    if not s.tie_word_embeddings:
        yield LM_HEAD, normal(s.vocab_size, s.hidden_size)


# Llama 3's chat format, so that a random-weight checkpoint answers /v1/chat/completions as a real
# Llama 3 checkpoint does (its headers are plain text to the small tokenizer).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def tokenizer_config(spec: ModelSpec) -> dict[str, Any]:
    """``tokenizer_config.json`` of a random-weight checkpoint: its special tokens and chat template."""
    from switchyard.service.engine.tokenizer import BOS_TEXT, EOS_TEXT

    return {"bos_token": BOS_TEXT if spec.bos_token_id is not None else None, "eos_token": EOS_TEXT,
            "model_max_length": spec.max_position_embeddings, "chat_template": CHAT_TEMPLATE}


def write_checkpoint(
    spec: ModelSpec, out: str | Path, seed: int = 0, shard_bytes: int = 4 << 30, progress: bool = True
) -> Path:
    """Write ``config.json``, ``*.safetensors`` (sharded with an index file when large) and a tokenizer."""
    from switchyard.service.engine.tokenizer import build_tokenizer  # tokenizer training only here

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(spec.to_config(), indent=2) + "\n")
    build_tokenizer(spec).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(spec), indent=2) + "\n")
    total = spec.param_bytes
    n_files = max(1, -(-total // shard_bytes))
    bar = progress_bar(progress, total=total, desc=f"writing {out.name}")
    shard: dict[str, np.ndarray] = {}
    shard_size = 0
    weight_map: dict[str, str] = {}
    file_no = 0

    def flush() -> None:
        nonlocal shard, shard_size, file_no
        file_no += 1
        name = "model.safetensors" if n_files == 1 else f"model-{file_no:05d}-of-{n_files:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        shard, shard_size = {}, 0

    for name, tensor in random_hf_tensors(spec, seed):
        if shard and shard_size + tensor.nbytes > shard_bytes and file_no + 1 < n_files:
            flush()
        shard[name] = tensor
        shard_size += tensor.nbytes
        bar.update(tensor.nbytes)
    flush()
    bar.close()
    if file_no > 1:
        # Rename to the true count if the estimate was off, so names match the index.
        if file_no != n_files:
            renamed = {}
            for old in sorted(set(weight_map.values())):
                k = int(old.split("-")[1])
                new = f"model-{k:05d}-of-{file_no:05d}.safetensors"
                (out / old).rename(out / new)
                renamed[old] = new
            weight_map = {t: renamed[f] for t, f in weight_map.items()}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out
