"""The weight type: a pytree the model and the row-parallel calls both take, whose dense kind is its
matrix and nothing more (the same products, the same traced program, sharded and donated alike)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels import native
from switchyard.kernels.selection import Capability
from switchyard.kernels.weights import DenseWeight, as_weight


def _mesh(world: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:world]), ("tp",))


def test_a_dense_weight_is_its_matrix_in_a_tree_and_in_products(rng) -> None:
    w = jnp.asarray(rng.standard_normal((24, 8)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, 24)), jnp.float32)
    dense = DenseWeight(w)
    assert jax.tree.leaves(dense) == [w] and (dense.shape, dense.dtype) == ((24, 8), jnp.float32)
    assert np.array_equal(x @ dense, x @ w)
    assert np.array_equal(dense.split_product(x, 4), kernels.split_product(x, w, 4))
    assert as_weight(w).w is w and as_weight(dense) is dense
    with pytest.raises(ValueError, match="cannot split K = 24 into 5"):
        dense.split_product(x, 5)
    # Sharded, donated and jitted as the bare array is.
    mesh = _mesh(2)
    tree = {"w": DenseWeight(jax.device_put(w, NamedSharding(mesh, P(None, "tp"))))}
    doubled = jax.jit(lambda t: jax.tree.map(lambda a: 2 * a, t), donate_argnums=0)(tree)
    assert isinstance(doubled["w"], DenseWeight) and doubled["w"].w.sharding.spec == P(None, "tp")
    assert np.array_equal(doubled["w"].w, 2 * w)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_row_parallel_call_traces_the_same_program_for_a_dense_weight_as_for_its_array(
        platform: str, monkeypatch) -> None:
    """Cross-lowered for CUDA (the fused kernel with partial products) and for CPU: a dense weight adds
    no op, no convert and no copy to the row-parallel product + all-reduce + residual + RMSNorm."""
    cap = Capability(True, world=2, oneshot_bytes=1 << 20, twoshot_bytes=1 << 24, reason="test")
    monkeypatch.setattr(native, "capability", lambda: cap)
    mesh = _mesh(2)

    def lowered(wrap) -> str:
        def body(a, wo, r, g):
            res, h = kernels.row_parallel_residual_rmsnorm(a, wrap(wo), r, g, 1e-5, "tp", "oneshot")
            return kernels.row_parallel_residual(a, wrap(wo), res + h, "tp", "oneshot")

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P(), P()),
                                   out_specs=P(), check_vma=False))
        specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec)) for shape, spec in
                 (((2, 256), P(None, "tp")), ((256, 256), P("tp", None)), ((2, 256), P()), ((256,), P()))]
        return fn.trace(*specs).lower(lowering_platforms=(platform,)).as_text()

    dense = lowered(DenseWeight)
    assert dense == lowered(lambda w: w)
    if platform == "cuda":
        assert "custom_call @switchyard_fused_rmsnorm" in dense
