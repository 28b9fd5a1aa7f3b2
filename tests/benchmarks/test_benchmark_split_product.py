"""benchmarks/split_product.py end to end on CPU: every variant of a product is built, its kernels
counted from the optimised HLO and a result row written (the times need a GPU's profile)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
from helpers import scripts


def test_variants_compute_the_same_product():
    sp = scripts.load("split_product")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)
    r = jnp.ones((2, 8), jnp.float32)
    want = np.asarray(x) @ np.asarray(w)
    np.testing.assert_allclose(np.asarray(sp.product("dot", x, w, r)), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sp.product("split4", x, w, r)).sum(0), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sp.product("split4+add", x, w, r)), want + 1, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(sp.product("dot+add", x, w, r)), want + 1, rtol=1e-5, atol=1e-5)


def test_result_file_has_a_row_per_variant(tmp_path):
    sp = scripts.load("split_product")
    out = tmp_path / "split.json"
    assert sp.main(["--layers", "2", "--reps", "1", "--splits", "2", "--shapes", "o_proj tp2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"].endswith(f"--out {out}") and result["device"].endswith(jax.devices()[0].device_kind)
    assert [r["variant"] for r in result["rows"]] == ["dot", "dot+add", "split2", "split2+add"]
    for row in result["rows"]:
        assert row["shape"] == "o_proj tp2" and (row["k"], row["n"]) == (2048, 4096)
        assert row["kernels_per_product"] >= 1  # counted in the optimised program
