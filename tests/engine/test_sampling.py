"""The sampler's candidates: top-k by groups gives what ``jax.lax.top_k`` gives, ties included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from switchyard.service.engine.sampling import top_k_by_groups


@pytest.mark.parametrize(("rows", "n", "k"), [(3, 1000, 7), (5, 4099, 64), (3, 8 * 130 + 3, 129), (4, 50, 16),
                                              (3, 12001, 1024)])
def test_top_k_by_groups_is_lax_top_k(rng, rows, n, k):
    x = rng.standard_normal((rows, n)).astype(np.float32)
    # bf16 logits widened: many exact ties, some across groups at the k-th value; a masked tail.
    x = np.asarray(jnp.asarray(x * 4, jnp.bfloat16), np.float32)
    x[0, : n // 3] = x[0].max()  # more ties at the top than k
    x[1, n - n // 4:] = -np.inf
    kth = np.sort(x[2])[-k]  # the k-th value repeated in groups all over the row
    x[2, rng.choice(n, size=min(n, 3 * k), replace=False)] = kth
    want_vals, want_idx = jax.lax.top_k(jnp.asarray(x), k)
    vals, idx = jax.jit(top_k_by_groups, static_argnums=1)(jnp.asarray(x), k)
    assert np.array_equal(np.asarray(vals), np.asarray(want_vals))
    assert np.array_equal(np.asarray(idx), np.asarray(want_idx))
