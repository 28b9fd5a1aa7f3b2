"""Hugging Face checkpoints: load straight into the sharded layout, and write random-weight ones.

Loading reads each device's slice of each tensor from the memory-mapped ``*.safetensors`` files and
places it on that device, so no device (and no host buffer) ever holds the whole model. A matrix goes
to the device as the checkpoint stores it ([out, in]) and is transposed there into the engine's
[in, out]: on the host a 2-byte transpose runs at 0.15-0.5 GB/s, which made a Llama-3-8B load take
56 s (benchmarks/NOTES.md).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file
from switchyard.kernels.weights import DenseWeight, Fp8Weight
from switchyard.service.engine.fp8_checkpoint import Fp8Matrices, fp8_hf_tensors, matrix_formats
from switchyard.service.engine.host import usable_cpus
from switchyard.service.engine.model import ShardShape, is_shape, param_shapes, param_specs, stage_stacked
from switchyard.service.engine.pipeline import check_stage_formats
from switchyard.service.engine.tensor_source import INDEX_FILE, CheckpointError, TensorSource
from switchyard.service.model.family import EMBED, FINAL_NORM, LM_HEAD, tensor_shape
from switchyard.service.modelspec import ModelSpec
from switchyard.service.progress import NoProgress, Progress, progress_bytes

# At most this many threads read tensors (or draw random ones) at once, each holding one layer's
# slices in host memory. A reader copies from the page cache at 2-3 GB/s; on a 16-core H100 host 16
# of them load Llama-3-8B's 16 GB in 1.4 s, 4 in 2.1 s (benchmarks/NOTES.md).
MAX_HOST_THREADS = 16
NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def progress_bar(show: bool, total: int, desc: str) -> Progress:
    """Progress over ``total`` bytes: a bar on a terminal, a line every few seconds in a log
    (``service.progress``), or nothing. No disabled tqdm when nothing shows: it still makes a
    multiprocessing lock, which an engine process that is killed (or exits at once) leaves behind, and
    the resource tracker then warns of a leaked semaphore when serve exits."""
    return progress_bytes(total, desc) if show else NoProgress()


def _held_bytes(shapes: Any, itemsize: int) -> int:
    """Bytes of a tree of shapes as held: ``itemsize`` an element, an FP8 weight's e4m3 values a byte
    each and its scales float32."""
    total = 0
    for leaf in jax.tree.leaves(shapes, is_leaf=lambda x: is_shape(x) or isinstance(x, Fp8Weight)):
        if isinstance(leaf, Fp8Weight):
            total += int(np.prod(leaf.w)) + 4 * int(np.prod(leaf.scale))
        else:
            total += itemsize * int(np.prod(leaf))
    return total


class Transposed:
    """A fetcher of a matrix's block in the checkpoint's orientation: called with the block's index in
    the engine's layout, it returns that block with its last two axes swapped."""

    def __init__(self, fetch: Callable[[tuple[slice, ...]], np.ndarray]) -> None:
        self.fetch = fetch


def _swap_last(items: tuple) -> tuple:
    return (*items[:-2], items[-1], items[-2])


@functools.cache
def _swap_on_device(sharding: NamedSharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: jnp.swapaxes(x, -1, -2), out_shardings=sharding)


def _shard_index(index: tuple[slice, ...], dim: int, width: int) -> int:
    start = index[dim].start or 0
    return start // width


def load_params(
    folder: str | Path, spec: ModelSpec, mesh: Mesh, dtype: str, progress: bool = True, stages: int = 1,
    quantization: str = "auto",
) -> dict:
    """Read a Hugging Face checkpoint of the spec's family (its tensor names: ``service/model``) into
    the engine's sharded parameter tree on ``mesh``.

    ``quantization``: ``auto`` holds each layer matrix as the files do (FP8 formats:
    ``fp8_checkpoint``), ``fp8`` holds every one in FP8 (16-bit tensors quantized here with a scale
    per output channel), ``none`` every one dense in ``dtype`` (FP8 tensors dequantized).

    With ``stages`` > 1 (a pipeline; the mesh has axes ``pp`` and ``tp``) each layer array gets a
    leading stage dimension sharded over ``pp``: entry j of ``layers`` holds, on stage s, layer
    ``s * layers_per_stage + j``; the LM head's vocabulary is split over every device of the mesh.
    """
    folder = Path(folder)
    src = TensorSource(folder)
    matrices = Fp8Matrices(src, spec)
    tp = mesh.shape["tp"]
    shape = ShardShape(spec, tp, vocab_shards=tp * stages)
    np_dtype = NP_DTYPES[dtype]
    s, hd = spec, spec.head_dim
    if s.num_layers % stages:
        raise ValueError(f"{stages} pipeline stages must divide the {s.num_layers} layers of {s.name}")
    formats = matrix_formats(matrices, spec, tp, quantization)
    check_stage_formats(formats, stages)
    shapes, specs = param_shapes(shape, formats), param_specs(spec, formats)
    per_stage = s.num_layers // stages

    def put(global_shape: tuple[int, ...], pspec, fetch: Callable | Transposed) -> jax.Array:
        sharding = NamedSharding(mesh, pspec)
        if not isinstance(fetch, Transposed):
            return jax.make_array_from_callback(global_shape, sharding, fetch)
        spec = (*pspec, *(None,) * (len(global_shape) - len(pspec)))
        stored = jax.make_array_from_callback(
            _swap_last(global_shape), NamedSharding(mesh, P(*_swap_last(spec))),
            lambda idx: np.asarray(fetch.fetch(_swap_last(idx))).astype(np_dtype, copy=False))
        return _swap_on_device(sharding)(stored)

    def dense(fetch: Callable[[tuple[slice, ...]], np.ndarray]) -> Callable[[tuple[slice, ...]], np.ndarray]:
        return lambda idx: np.asarray(fetch(idx)).astype(np_dtype, copy=False)

    def whole(name: str, expected: tuple[int, ...]) -> Callable[[tuple[slice, ...]], np.ndarray]:
        return dense(lambda idx: src.slice(name, expected)[idx])

    def column_block(parts: list[tuple[str, int, int]], width: int) -> Transposed:
        """Shard r's columns = concat of rows [r*n, (r+1)*n) of each HF [out, in] tensor, transposed."""
        def fetch(idx: tuple[slice, ...]) -> np.ndarray:
            r = _shard_index(idx, 1, width)
            blocks = [matrices.read(name, (out, s.hidden_size), (slice(r * n, (r + 1) * n), slice(None)))
                      for name, out, n in parts]
            return np.concatenate(blocks, axis=0)[:, idx[0]]
        return Transposed(fetch)

    def fp8_column_block(parts: list[tuple[str, int, int]], width: int) -> Fp8Weight:
        """The FP8 form of :func:`column_block`: shard r's output channels, [width, in] and their scales."""
        def fetch(idx: tuple[slice, ...], which: int) -> np.ndarray:
            r = _shard_index(idx, 0, width)
            got = [matrices.part(name, out, s.hidden_size, slice(r * n, (r + 1) * n), slice(None))
                   for name, out, n in parts]
            return np.concatenate([g[which] for g in got], axis=0)[:, idx[1]]
        return Fp8Weight(lambda idx: fetch(idx, 0), lambda idx: fetch(idx, 1))

    def vector_block(parts: list[tuple[str, int, int]], width: int) -> Callable[[tuple[slice, ...]], np.ndarray]:
        """Shard r's entries = concat of entries [r*n, (r+1)*n) of each HF [out] vector (biases)."""
        def fetch(idx: tuple[slice, ...]) -> np.ndarray:
            r = _shard_index(idx, 0, width)
            return np.concatenate([src.slice(name, (out,), slice(r * n, (r + 1) * n)) for name, out, n in parts])
        return dense(fetch)

    def row_block(name: str, expected: tuple[int, ...]) -> Transposed:
        """HF [out, in] tensor used as [in, out], sharded by its input rows (= the tensor's columns)."""
        return Transposed(lambda idx: matrices.read(name, expected, (idx[1], idx[0])))

    def fp8_row_block(name: str, expected: tuple[int, int], block_k: int) -> Fp8Weight:
        """The FP8 form of :func:`row_block`: [out, in] sharded by input feature, the scales with it
        (per-channel scales whole on every shard, block scales by block of K)."""
        def weight(idx: tuple[slice, ...]) -> np.ndarray:
            return matrices.part(name, *expected, slice(None), idx[1])[0][idx[0]]

        def scale(idx: tuple[slice, ...]) -> np.ndarray:
            return matrices.full_scales(name, *expected)[idx]

        return Fp8Weight(weight, scale, block_k)

    q_l, kv_l = shape.q_heads * hd, shape.kv_heads * hd

    def layer_fetchers(i: int) -> dict[str, Any]:
        """Layer i's tree of fetchers, shaped as its parameters (a weight holds its arrays')."""
        n = s.family.layer_names(i)
        fmt = formats[i]
        qkv = [(n["q"], s.q_size, q_l), (n["k"], s.kv_size, kv_l), (n["v"], s.kv_size, kv_l)]
        gu = [(n["gate"], s.intermediate_size, shape.inter), (n["up"], s.intermediate_size, shape.inter)]

        def column(name: str, parts: list[tuple[str, int, int]], width: int) -> Any:
            if fmt[name].fp8:
                return dataclasses.replace(fp8_column_block(parts, width), block_k=fmt[name].block_k)
            return DenseWeight(column_block(parts, width))

        def row(name: str, tensor: str, expected: tuple[int, int]) -> Any:
            if fmt[name].fp8:
                return fp8_row_block(tensor, expected, fmt[name].block_k)
            return DenseWeight(row_block(tensor, expected))

        fetchers: dict[str, Any] = {
            "attn_norm": whole(n["attn_norm"], (s.hidden_size,)),
            "mlp_norm": whole(n["mlp_norm"], (s.hidden_size,)),
            "wqkv": column("wqkv", qkv, shape.qkv_cols),
            "wo": row("wo", n["o"], (s.hidden_size, s.q_size)),
            "wgu": column("wgu", gu, 2 * shape.inter),
            "wdown": row("wdown", n["down"], (s.hidden_size, s.intermediate_size)),
        }
        if s.attention_bias:
            fetchers["bqkv"] = vector_block(
                [(n["q_bias"], s.q_size, q_l), (n["k_bias"], s.kv_size, kv_l), (n["v_bias"], s.kv_size, kv_l)],
                shape.qkv_cols)
        if s.qk_norm:
            fetchers["q_norm"] = whole(n["q_norm"], tensor_shape("q_norm", s))
            fetchers["k_norm"] = whole(n["k_norm"], tensor_shape("k_norm", s))
        return fetchers

    def stage_fetch(j: int, leaf: int, transposed: bool) -> Callable[[tuple[slice, ...]], np.ndarray] | Transposed:
        """Leaf ``leaf`` of entry j of the stage-stacked layers: stage s's block is layer s * per_stage + j
        (``transposed``: that leaf's fetcher is a :class:`Transposed`, as it is for every stage)."""
        def fetch(idx: tuple[slice, ...]) -> np.ndarray:
            stage = idx[0].start or 0
            inner = jax.tree.leaves(layer_fetchers(stage * per_stage + j))[leaf]
            return (inner.fetch if transposed else inner)(idx[1:])[None]
        return Transposed(fetch) if transposed else fetch

    rep = P()
    itemsize = np.dtype(np_dtype).itemsize
    total = stages * sum(_held_bytes(layer, itemsize) for layer in shapes["layers"][:per_stage]) + itemsize * sum(
        int(np.prod(shapes[name])) for name in ("embed", "final_norm", "lm_head"))
    # Before any tensor is read: a checkpoint without its LM head fails at once, not after every layer.
    head_name = EMBED if s.tie_word_embeddings else LM_HEAD
    if not s.tie_word_embeddings and head_name not in src:
        raise CheckpointError("checkpoint has no lm_head.weight and the config does not tie word embeddings")
    bar = progress_bar(progress, total=total, desc=f"loading {folder.name}")
    params: dict[str, Any] = {"layers": []}
    params["embed"] = put(shapes["embed"], rep, whole(EMBED, (s.vocab_size, s.hidden_size)))
    bar.update(params["embed"].nbytes)

    def load_layer(j: int) -> dict[str, Any]:
        lshape, lspec = shapes["layers"][j], specs["layers"][j]
        if stages == 1:
            fetchers = layer_fetchers(j)
            return {name: jax.tree.map(put, lshape[name], lspec[name], fetchers[name], is_leaf=is_shape)
                    for name in lshape}
        lshape, lspec = stage_stacked(lshape, lspec, stages, "pp")
        leaves, treedef = jax.tree.flatten(lshape, is_leaf=is_shape)
        transposed = [isinstance(f, Transposed) for f in jax.tree.leaves(layer_fetchers(j))]
        return jax.tree.unflatten(treedef, [put(shp, ps, stage_fetch(j, k, transposed[k])) for k, (shp, ps) in
                                            enumerate(zip(leaves, jax.tree.leaves(lspec), strict=True))])

    # Layers load side by side: reading a memory map and copying to the devices release the GIL.
    with ThreadPoolExecutor(min(MAX_HOST_THREADS, usable_cpus(), per_stage)) as pool:
        for layer in pool.map(load_layer, range(per_stage)):
            params["layers"].append(layer)
            bar.update(sum(leaf.nbytes for leaf in jax.tree.leaves(layer)))
    params["final_norm"] = put(shapes["final_norm"], rep, whole(FINAL_NORM, (s.hidden_size,)))
    bar.update(params["final_norm"].nbytes)
    local_vocab = shape.padded_vocab // (tp * stages)

    def head(idx: tuple[slice, ...]) -> np.ndarray:
        r = _shard_index(idx, 1, local_vocab)
        lo, hi = r * local_vocab, min((r + 1) * local_vocab, s.vocab_size)
        block = np.zeros((local_vocab, s.hidden_size), dtype=np_dtype)
        if hi > lo:
            block[: hi - lo] = src.slice(head_name, (s.vocab_size, s.hidden_size), slice(lo, hi))
        return block[:, idx[0]]

    head_spec = specs["lm_head"] if stages == 1 else P(None, ("pp", "tp"))
    params["lm_head"] = put(shapes["lm_head"], head_spec, Transposed(head))
    bar.update(params["lm_head"].nbytes)
    bar.close()
    return params


# ---- random-weight checkpoints -------------------------------------------------------------------
def random_hf_tensors(spec: ModelSpec, seed: int) -> Iterator[tuple[str, np.ndarray]]:
    """Hugging Face-named random tensors, in the checkpoint's order, scaled like a trained model's (std
    0.02). Each is drawn from a generator of its own, seeded by ``seed`` and its place in that order,
    so that several are made side by side (drawing and converting release the GIL): one thread draws
    about 0.1 GB/s of bf16, and Llama-3-8B's 16 GB took two and a half minutes one after another."""
    s = spec
    dtype = NP_DTYPES[s.dtype]
    plan: list[tuple[str, tuple[int, ...], bool]] = [(EMBED, (s.vocab_size, s.hidden_size), False)]
    for i in range(s.num_layers):
        names, shapes = s.family.layer_names(i), s.family.layer_shapes(s)
        for role, name in names.items():  # the family's tensors: biases and q/k norms too
            plan.append((name, shapes[role], role.endswith("norm")))
    plan.append((FINAL_NORM, (s.hidden_size,), True))
    if not s.tie_word_embeddings:
        plan.append((LM_HEAD, (s.vocab_size, s.hidden_size), False))

    def draw(place: int, shape: tuple[int, ...], norm: bool) -> np.ndarray:
        values = np.random.default_rng([seed, place]).standard_normal(shape, dtype=np.float32)
        return (1.0 + 0.1 * values if norm else 0.02 * values).astype(dtype)

    workers = min(MAX_HOST_THREADS, usable_cpus())
    with ThreadPoolExecutor(workers) as pool:
        # At most two tensors a worker drawn ahead of the writer: host memory stays bounded.
        ahead: collections.deque[tuple[str, Future]] = collections.deque()
        for place, (name, shape, norm) in enumerate(plan):
            ahead.append((name, pool.submit(draw, place, shape, norm)))
            if len(ahead) > 2 * workers:
                first, future = ahead.popleft()
                yield first, future.result()
        while ahead:
            first, future = ahead.popleft()
            yield first, future.result()


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
    """Write ``config.json``, ``*.safetensors`` (sharded with an index file when large) and a tokenizer;
    with ``spec.quantization``, the layer matrices in that FP8 format."""
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

    tensors = random_hf_tensors(spec, seed)
    if spec.quantization is not None:  # the layer matrices in the FP8 format's published layout
        tensors = fp8_hf_tensors(spec, spec.quantization, tensors)
    for name, tensor in tensors:
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
