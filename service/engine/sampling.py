"""Per-request sampling: parameters, their validation, and the sampler that runs inside the step.

The sampler runs inside ``jax.shard_map`` on vocabulary-sharded logits, so that no device gathers
the whole vocabulary: each shard proposes its best candidates and only those travel.
Randomness for a request depends on its seed and its output position alone, so a request draws
the same tokens whether it runs alone or in a batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from switchyard.service.errors import InvalidRequestError

# Top-k and nucleus sampling consider at most this many candidates (per request). With top_k off and
# top_p < 1, the nucleus is cut at the top MAX_TOP_K tokens; plain temperature sampling (top_k off,
# top_p = 1) samples the full vocabulary.
MAX_TOP_K = 1024
MAX_SEED = 2**31 - 1
# The top k of a row lie in the k groups of this many adjacent columns with the largest maxima, so a
# shard's candidates come from two sorts, of its columns' group maxima and of those groups' columns,
# instead of one sort of all its columns (XLA sorts for top-k: over 128K columns, 1 ms for 64 rows on
# an H100; benchmarks/NOTES.md).
TOP_K_GROUP = 8


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not isinstance(t, (int, float)) or not 0.0 <= t <= 100.0 or t != t:
            raise InvalidRequestError(f"temperature must be between 0 and 100 (0 = greedy), got {t}")
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_K:
            raise InvalidRequestError(f"top_k must be an integer between 0 (off) and {MAX_TOP_K}, got {k}")
        if not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p}")
        if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= MAX_SEED:
            raise InvalidRequestError(f"seed must be an integer between 0 and {MAX_SEED}, got {s}")


def request_keys(seeds: jax.Array, counters: jax.Array) -> jax.Array:
    """One PRNG key per row, from that request's seed and output position."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)


def sample_sharded(
    logits: jax.Array,
    vocab_size: int,
    axis: str,
    *,
    greedy_only: bool,
    temperature: jax.Array | None = None,
    top_k: jax.Array | None = None,
    top_p: jax.Array | None = None,
    seeds: jax.Array | None = None,
    counters: jax.Array | None = None,
) -> jax.Array:
    """Pick one token per row from ``logits`` [rows, local_vocab], sharded over ``axis`` by column.

    Must run inside ``shard_map``; returns int32 [rows], identical on every shard.
    """
    local_vocab = logits.shape[1]
    shard = jax.lax.axis_index(axis)
    offset = shard * local_vocab
    column = offset + jnp.arange(local_vocab)
    logits = jnp.where(column[None, :] < vocab_size, logits.astype(jnp.float32), -jnp.inf)

    greedy_tok = _global_argmax(logits, offset, axis)
    if greedy_only:
        return greedy_tok
    assert temperature is not None and top_k is not None and top_p is not None
    assert seeds is not None and counters is not None

    scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
    keys = request_keys(seeds, counters)

    # Full-vocabulary sampling (Gumbel-max): noise is drawn for the whole padded vocabulary from the
    # request's key and each shard takes its own columns, so the draw does not depend on tp.
    padded_vocab = local_vocab * jax.lax.psum(1, axis)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (padded_vocab,), jnp.float32))(keys)
    local_noise = jax.lax.dynamic_slice_in_dim(noise, offset, local_vocab, axis=1)
    full_tok = _global_argmax(scaled + local_noise, offset, axis)

    # Top-k / top-p over candidates: each shard proposes its best k, then the best k overall.
    k_cap = min(MAX_TOP_K, vocab_size, local_vocab)
    vals, idx = top_k_by_groups(scaled, k_cap)
    all_vals = jax.lax.all_gather(vals, axis, axis=1, tiled=True)
    all_idx = jax.lax.all_gather(idx + offset, axis, axis=1, tiled=True)
    k_total = min(MAX_TOP_K, vocab_size)
    cand_vals, pos = jax.lax.top_k(all_vals, k_total)
    cand_idx = jnp.take_along_axis(all_idx, pos, axis=1)
    rank = jnp.arange(k_total)[None, :]
    k_eff = jnp.where(top_k > 0, top_k, k_total)[:, None]
    keep = rank < k_eff
    probs = jax.nn.softmax(jnp.where(keep, cand_vals, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < top_p[:, None]
    cand_noise = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 1), (k_total,), jnp.float32))(keys)
    choice = jnp.argmax(jnp.where(keep, cand_vals, -jnp.inf) + cand_noise, axis=-1)
    cand_tok = jnp.take_along_axis(cand_idx, choice[:, None], axis=1)[:, 0]

    use_full = (top_k == 0) & (top_p >= 1.0)
    tok = jnp.where(use_full, full_tok, cand_tok)
    return jnp.where(temperature == 0.0, greedy_tok, tok).astype(jnp.int32)


def top_k_by_groups(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(x, k)`` over the columns of ``x`` [rows, n], the same values and indices (ties
    to the lower index), found among the columns of the ``k`` groups of :data:`TOP_K_GROUP` with the
    largest maxima. Exact: at most ``k`` groups hold a value above the k-th largest, and among groups
    whose maximum ties with it the lower ones come first, as the tied values do."""
    rows, n = x.shape
    groups = -(-n // TOP_K_GROUP)
    if groups <= k:
        return jax.lax.top_k(x, k)
    padded = jnp.pad(x, ((0, 0), (0, groups * TOP_K_GROUP - n)), constant_values=-jnp.inf)
    grouped = padded.reshape(rows, groups, TOP_K_GROUP)
    _, best = jax.lax.top_k(grouped.max(axis=-1), k)
    best = jnp.sort(best, axis=-1)  # the candidates in column order, so that ties still go to the lower index
    candidates = jnp.take_along_axis(grouped, best[:, :, None], axis=1).reshape(rows, k * TOP_K_GROUP)
    columns = (best[:, :, None] * TOP_K_GROUP + jnp.arange(TOP_K_GROUP)).reshape(rows, k * TOP_K_GROUP)
    vals, pos = jax.lax.top_k(candidates, k)
    return vals, jnp.take_along_axis(columns, pos, axis=1)


def _global_argmax(values: jax.Array, offset: jax.Array, axis: str) -> jax.Array:
    """Argmax over a column-sharded matrix; ties go to the lowest global index, as in ``jnp.argmax``."""
    local_idx = jnp.argmax(values, axis=-1)
    local_max = jnp.take_along_axis(values, local_idx[:, None], axis=1)[:, 0]
    maxes = jax.lax.all_gather(local_max, axis, axis=1)  # [rows, shards]
    idxs = jax.lax.all_gather(local_idx + offset, axis, axis=1)
    best_shard = jnp.argmax(maxes, axis=-1)
    return jnp.take_along_axis(idxs, best_shard[:, None], axis=1)[:, 0].astype(jnp.int32)
