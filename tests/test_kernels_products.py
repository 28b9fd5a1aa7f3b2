"""Decode products (switchyard.kernels.products): the reference semantics against float64 on CPU, the
CUDA lowering (cross-lowered on CPU), and the CUDA kernel against float64 on fresh random inputs
(marked ``gpu``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from switchyard.kernels import native, products


def random_case(rng, n: int, k: int, cols: int, dtype, residual: bool):
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    x = cast(rng.standard_normal((n, k)))
    w = cast(rng.standard_normal((k, cols)) / np.sqrt(k))
    r = cast(rng.standard_normal((n, cols))) if residual else None
    return x, w, r


def reference_f64(x, w, r) -> np.ndarray:
    y = np.asarray(x.astype(jnp.float32), np.float64) @ np.asarray(w.astype(jnp.float32), np.float64)
    return y if r is None else y + np.asarray(r.astype(jnp.float32), np.float64)


@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_reference_rounds_once_and_matches_float64(residual: bool) -> None:
    rng = np.random.default_rng(11)
    x, w, r = random_case(rng, 3, 40, 24, jnp.bfloat16, residual)
    got = products.decode_product(x, w, r)  # CPU: the reference path
    assert got.dtype == jnp.bfloat16 and got.shape == (3, 24)
    want = reference_f64(x, w, r)
    # One rounding of the float32 result: within half a bf16 ulp of the float64 value (plus f32 sums).
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=2**-8, atol=1e-6)
    assert np.array_equal(np.asarray(got), np.asarray(jnp.asarray(want.astype(np.float32)).astype(jnp.bfloat16)))


def test_bad_shapes_are_refused() -> None:
    x, w = jnp.ones((2, 64), jnp.bfloat16), jnp.ones((64, 32), jnp.bfloat16)
    with pytest.raises(ValueError, match="x \\[..., K\\] and w \\[K, N\\]"):
        products.decode_product(x, jnp.ones((32, 32), jnp.bfloat16))
    with pytest.raises(ValueError, match="residual must be"):
        products.decode_product(x, w, jnp.ones((3, 32), jnp.bfloat16))


def test_kernel_supports_only_what_the_kernel_handles() -> None:
    ok = (jnp.ones((2, 512), jnp.bfloat16), jnp.ones((512, 96), jnp.bfloat16))
    assert products.kernel_supports(*ok)
    assert products.kernel_supports(*ok, jnp.ones((2, 96), jnp.bfloat16))
    assert not products.kernel_supports(jnp.ones((9, 512), jnp.bfloat16), ok[1])  # rows
    assert not products.kernel_supports(jnp.ones((2, 520), jnp.bfloat16), jnp.ones((520, 96), jnp.bfloat16))  # K
    assert not products.kernel_supports(ok[0], jnp.ones((512, 80), jnp.bfloat16))  # N
    assert not products.kernel_supports(ok[0].astype(jnp.float32), ok[1].astype(jnp.float32))  # dtype
    assert not products.kernel_supports(*ok, jnp.ones((2, 96), jnp.float16))  # mixed dtypes


@pytest.fixture
def fake_kernels_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the single-GPU kernels are loaded, so that the CUDA branch is traced (and lowered
    for CUDA; the CPU lowering still picks the reference)."""
    monkeypatch.setattr(native, "attention_ready", lambda: True)


def test_cuda_lowering_emits_the_product_calls(fake_kernels_ready) -> None:
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 512), (512, 96), (2, 96))]
    fn = jax.jit(lambda x, w, r: (products.decode_product(x, w), products.decode_product(x, w, r)))
    text = fn.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @switchyard_decode_product(" in text
    assert "custom_call @switchyard_decode_product_residual(" in text
    cpu = fn.trace(*specs).lower(lowering_platforms=("cpu",)).as_text()
    assert "switchyard" not in cpu


def test_tp1_engine_step_runs_its_products_through_the_kernel(fake_kernels_ready) -> None:
    """At TP=1 each layer's QKV product is a plain call and the output and down products carry the
    residual add; with ``product_kernel=False`` none is emitted."""
    from engine_fixtures import kernel_sized_spec
    from switchyard.service.engine import Engine
    from switchyard.service.modelspec import ServingLayout

    spec = kernel_sized_spec()
    layout = ServingLayout(tp=1, batch_slots=2, max_seq_len=64)
    for use in (True, False):
        engine = Engine.from_random(spec, layout, devices=jax.devices("cpu")[:1], cache_init="zeros",
                                    product_kernel=use)
        step = engine._step_fn(2, True, False)
        text = step.trace(engine.params, engine._state).lower(lowering_platforms=("cuda",)).as_text()
        plain = text.count("custom_call @switchyard_decode_product(")
        with_residual = text.count("custom_call @switchyard_decode_product_residual(")
        assert (plain, with_residual) == ((spec.num_layers, 2 * spec.num_layers) if use else (0, 0))


# ---- GPU ----------------------------------------------------------------------------------------------
GPU_CASES = [  # rows, K, N
    (1, 512, 32),
    (2, 4096, 6144),
    (3, 1536, 96),
    (5, 1024, 4128),
    (8, 14336, 512),
    (2, 2048, 4096),
]


@pytest.mark.gpu
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "n{}-K{}-N{}".format(*c))
def test_kernel_matches_float64(case, dtype, residual: bool) -> None:
    assert native.attention_ready(), native.status()
    n, k, cols = case
    rng = np.random.default_rng(abs(hash((case, dtype, residual))) % 2**32)
    x, w, r = random_case(rng, n, k, cols, dtype, residual)
    assert products.kernel_supports(x, w, r)
    fn = jax.jit(products.decode_product)
    # Every element is compared with float64, so an element the kernel did not write shows; so does
    # a kernel that reads rows past n (x is a slice of a NaN-padded buffer).
    padded = jnp.concatenate([x, jnp.full((products.MAX_ROWS, k), jnp.nan, x.dtype)])
    got = jax.jit(lambda p, w, r: products.decode_product(p[:n], w, r))(padded, w, r)
    got2 = fn(x, w, r)
    want = reference_f64(x, w, r)
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < (8e-3 if dtype == "bfloat16" else 1e-3), err
    assert np.array_equal(np.asarray(got2.astype(jnp.float32), np.float64), got)  # the same bits every run
    assert "switchyard_decode_product" in fn.lower(x, w, r).as_text()


@pytest.mark.gpu
def test_engine_with_the_product_kernel_decodes_as_with_xla_dots() -> None:
    from engine_fixtures import assert_decode_alike, kernel_sized_spec
    from switchyard.service.engine import Engine
    from switchyard.service.modelspec import ServingLayout

    spec = kernel_sized_spec()
    layout = ServingLayout(tp=1, batch_slots=4, max_seq_len=300)
    engines = [Engine.from_random(spec, layout, devices=jax.devices()[:1], product_kernel=k, cache_init="zeros")
               for k in (True, False)]
    assert_decode_alike(engines, [[1, 5, 9, 200], [1, *range(3, 140)], [1, 77]], steps=12)
