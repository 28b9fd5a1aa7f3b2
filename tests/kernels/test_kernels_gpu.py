"""GPU tests of the custom all-reduce kernels (marked ``gpu``; skipped without a GPU).

Run on a node with >= 2 GPUs and peer access, with command buffers forced on for custom calls:
  XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL
             --xla_gpu_graph_min_graph_size=1" pytest -m gpu tests/kernels/test_kernels_gpu.py
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.emulated_ranks import rel, same_bits
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels import collectives, native

pytestmark = pytest.mark.gpu

DTYPES = ("float32", "bfloat16", "float16")
# ||out - ref|| / ||ref|| against float64, inputs rounded to the dtype first: the only error left
# is the final rounding of the sum (and of the norm), so these are a few ulps of each dtype.
TOL = {"float32": 1e-6, "bfloat16": 8e-3, "float16": 1e-3}
SIZES = (1, 7, 4097, (1 << 20) + 3)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    devs = jax.devices("gpu")
    if len(devs) < 2:
        pytest.skip("needs >= 2 GPUs")
    cap = kernels.init(devs)
    assert cap.available, kernels.status()
    kernels.set_timeout(10.0)
    return Mesh(np.array(devs), ("tp",))


def test_registry_sets_and_reads_the_launch_counters_on_every_gpu() -> None:
    """Any number of GPUs (one too): init gives every GPU a workspace whose launch counters all start
    equal, reset sets every entry (a counter that disagreed between block indices reads -1)."""
    devs = jax.devices("gpu")
    assert kernels.init(devs).available, kernels.status()
    for epoch in (123, 2**32 - 1, 0):
        kernels.reset(epoch)
        assert [native.device_calls(r) for r in range(len(devs))] == [epoch] * len(devs)


def _put(mesh: Mesh, a: np.ndarray, dtype: str, spec: P) -> jax.Array:
    return jax.device_put(jnp.asarray(a, dtype=dtype), NamedSharding(mesh, spec))


def _f64(a: jax.Array) -> np.ndarray:
    return np.asarray(a.astype(jnp.float32)).astype(np.float64)


@functools.cache
def _allreduce_fn(mesh: Mesh, strategy: str):
    """Per-rank outputs [world, n]; the second argument is a NaN-filled buffer donated for the
    output, so any element the kernel fails to write stays NaN (where XLA reuses it)."""

    def body(x, poison):
        del poison
        return kernels.all_reduce(x[0], "tp", strategy)[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P("tp")), out_specs=P("tp"), check_vma=False)
    return jax.jit(fn, donate_argnums=1)


def _lowered_text(fn, *args) -> str:
    return fn.lower(*args).as_text()


@pytest.mark.parametrize("strategy", ["oneshot", "twoshot", "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_matches_float64(mesh: Mesh, strategy: str, dtype: str, rng) -> None:
    world = mesh.devices.size
    fn = _allreduce_fn(mesh, strategy)
    for n in SIZES:
        poison = _put(mesh, np.full((world, n), np.nan, np.float32), dtype, P("tp"))
        # Fill the workspaces with NaN first: a kernel that read a stale slot would return NaN.
        _ = np.asarray(fn(poison, _put(mesh, np.zeros((world, n)), dtype, P("tp"))))
        x = _put(mesh, rng.standard_normal((world, n)), dtype, P("tp"))
        if strategy != "auto":
            assert f"switchyard_{strategy}" in _lowered_text(fn, x, poison), "kernel not staged"
        out = fn(x, _put(mesh, np.full((world, n), np.nan, np.float32), dtype, P("tp")))
        got = np.asarray(out)
        assert not np.isnan(got.astype(np.float32)).any(), f"unwritten or stale elements, n={n}"
        ref = _f64(x).sum(axis=0)
        for r in range(world):
            assert rel(_f64(out)[r], ref) < TOL[dtype], (n, r)
        assert same_bits(got), f"ranks differ, n={n}"
    kernels.check_errors()


@functools.cache
def _fused_fn(mesh: Mesh, strategy: str, eps: float):
    def body(x, res, w):
        nr, normed = kernels.all_reduce_residual_rmsnorm(x[0], res, w, eps, "tp", strategy)
        return nr[None], normed[None]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"), P("tp")), check_vma=False)
    return jax.jit(fn)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 4096), (5, 1000), (3, 4097), (64, 8192), (2, 8)])
def test_fused_matches_float64(mesh: Mesh, dtype: str, rows: int, hidden: int, rng) -> None:
    world, eps = mesh.devices.size, 1e-5
    fn = _fused_fn(mesh, "oneshot", eps)
    x = _put(mesh, rng.standard_normal((world, rows, hidden)), dtype, P("tp"))
    res = _put(mesh, rng.standard_normal((rows, hidden)), dtype, P())
    w = _put(mesh, rng.uniform(0.5, 1.5, hidden), dtype, P())
    assert "switchyard_fused_rmsnorm" in _lowered_text(fn, x, res, w), "fused kernel not staged"
    nr, normed = fn(x, res, w)
    s = _f64(x).sum(axis=0)
    ref_nr = _f64(res) + s
    ref_normed = _f64(w) * ref_nr / np.sqrt(np.mean(ref_nr**2, axis=-1, keepdims=True) + eps)
    for r in range(world):
        assert rel(_f64(nr)[r], ref_nr) < TOL[dtype]
        assert rel(_f64(normed)[r], ref_normed) < 3 * TOL[dtype]
    assert same_bits(np.asarray(nr)) and same_bits(np.asarray(normed))
    kernels.check_errors()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("splits", "rows", "hidden"), [(4, 2, 4096), (3, 5, 1000), (1, 3, 4097), (4, 64, 8192)])
def test_fused_with_partial_products_matches_float64(mesh: Mesh, dtype: str, splits: int, rows: int,
                                                     hidden: int, rng) -> None:
    """Each rank passes float32 partial products; its contribution is their sum rounded to the dtype."""
    world, eps = mesh.devices.size, 1e-5

    def body(p, res, w):
        nr, normed = kernels.all_reduce_residual_rmsnorm(p[0], res, w, eps, "tp", "oneshot")
        return nr[None], normed[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"), P("tp")),
                               check_vma=False))
    parts = _put(mesh, rng.standard_normal((world, splits, rows, hidden)), "float32", P("tp"))
    res = _put(mesh, rng.standard_normal((rows, hidden)), dtype, P())
    w = _put(mesh, rng.uniform(0.5, 1.5, hidden), dtype, P())
    call = next(ln for ln in _lowered_text(fn, parts, res, w).splitlines() if "switchyard_fused_rmsnorm" in ln)
    assert f"tensor<{splits}x{rows}x{hidden}xf32>" in call, call
    nr, normed = fn(parts, res, w)
    # Each rank's contribution as the kernel forms it: float32 sum of its slices, rounded to the dtype.
    contrib = np.asarray(jnp.asarray(np.asarray(parts, np.float32).sum(axis=1), dtype).astype(jnp.float32), np.float64)
    ref_nr = _f64(res) + contrib.sum(axis=0)
    ref_normed = _f64(w) * ref_nr / np.sqrt(np.mean(ref_nr**2, axis=-1, keepdims=True) + eps)
    assert not np.isnan(_f64(nr)).any() and not np.isnan(_f64(normed)).any()
    for r in range(world):
        assert rel(_f64(nr)[r], ref_nr) < 2 * TOL[dtype]
        assert rel(_f64(normed)[r], ref_normed) < 4 * TOL[dtype]
    assert same_bits(np.asarray(nr)) and same_bits(np.asarray(normed))
    kernels.check_errors()


def test_engine_with_partial_products_decodes_like_psum(mesh: Mesh) -> None:
    """Engines over every GPU of the mesh on the same bf16 weights: auto (fused kernel taking partial
    products, command buffers as XLA sets them) against XLA's psum, logits step after step."""
    import dataclasses

    from helpers.engine_fixtures import assert_decode_alike, kernel_sized_spec
    from switchyard.service.engine.engine import Engine, EngineConfig
    from switchyard.service.engine.step_policy import StepShape
    from switchyard.service.modelspec import ServingLayout

    world = mesh.devices.size  # the kernels serve one group per process: the mesh's
    spec = dataclasses.replace(kernel_sized_spec(), num_heads=4 * world, num_kv_heads=world, hidden_size=256 * world)
    layout = ServingLayout(tp=world, batch_slots=4, max_seq_len=256)
    engines = [Engine.from_random(spec, layout, EngineConfig(batch_slots=4, max_seq_len=256, strategy=s,
                                                             dtype="bfloat16", step_tokens=64, kv_tokens=4 * 256),
                                  devices=list(mesh.devices.flat)) for s in ("auto", "xla")]
    step = engines[0]._program("step", StepShape(4))
    compiled = step.lower(engines[0].params, engines[0]._state, engines[0]._io).compile().as_text()
    assert compiled.count("switchyard_fused_rmsnorm") >= 2 * spec.num_layers - 1
    for prompt in ([1, 5, 9, 200], [1, *range(3, 100)], [1, 77]):
        assert_decode_alike(engines, prompt, steps=10)
    kernels.check_errors()


@pytest.mark.parametrize("strategy", ["oneshot", "twoshot", "fused"])
def test_100k_calls_in_one_jitted_loop_across_epoch_wrap(mesh: Mesh, strategy: str, rng) -> None:
    """100 000 back-to-back all-reduces inside one jitted fori_loop, starting the epoch counters
    50 000 below 2^32 so they wrap. Integer-valued float32 data: sum(x) * world / world is exact,
    so the result after the loop must equal sum(x) exactly."""
    world, iters = mesh.devices.size, 100_000
    start = 2**32 - 50_000
    kernels.reset(start)
    xs = rng.integers(-8, 8, (world, 4, 1024)).astype(np.float32)
    inv = 1.0 / world

    def body(x):
        def step(_, v):
            if strategy == "fused":
                zero, ones = jnp.zeros_like(v), jnp.ones(v.shape[-1], v.dtype)
                nr, _ = kernels.all_reduce_residual_rmsnorm(v, zero, ones, 1e-5, "tp", "oneshot")
                return nr * inv
            return kernels.all_reduce(v, "tp", strategy) * inv

        v = kernels.all_reduce(x[0], "tp", "xla")  # every rank starts from the same sum
        return jax.lax.fori_loop(0, iters, step, v)[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"), check_vma=False))
    x = _put(mesh, xs, "float32", P("tp"))
    target = "fused_rmsnorm" if strategy == "fused" else strategy
    assert f"switchyard_{target}" in _lowered_text(fn, x)
    out = np.asarray(fn(x))
    kernels.check_errors()
    for r in range(world):
        np.testing.assert_array_equal(out[r], xs.sum(axis=0))
        assert native.device_calls(r) == (start + iters) % 2**32
    kernels.reset(0)


def test_decode_like_step_with_command_buffers(mesh: Mesh, rng) -> None:
    """A jitted step (matmul -> all-reduce -> matmul -> fused all-reduce + residual + norm) runs
    with command buffers on: the optimized HLO must hold our custom calls and a command buffer,
    and 10 chained steps must track the XLA psum strategy."""
    flags = os.environ.get("XLA_FLAGS", "")
    assert "CUSTOM_CALL" in flags, "run with --xla_gpu_enable_command_buffer=...,CUSTOM_CALL"
    world, hidden, eps = mesh.devices.size, 4096, 1e-5

    def step(strategy):
        def body(h, res, w1, w2, g):
            a = kernels.all_reduce(h @ w1, "tp", strategy)
            res, n = kernels.all_reduce_residual_rmsnorm(a @ w2, res, g, eps, "tp", strategy)
            return res, n

        return jax.jit(
            jax.shard_map(
                body, mesh=mesh, in_specs=(P(), P(), P(None, "tp"), P("tp", None), P()), out_specs=(P(), P()),
                check_vma=False,
            )
        )

    h = _put(mesh, rng.standard_normal((1, hidden)) * 0.1, "bfloat16", P())
    res = _put(mesh, rng.standard_normal((1, hidden)), "bfloat16", P())
    w1 = _put(mesh, rng.standard_normal((hidden, hidden)) / 64, "bfloat16", P(None, "tp"))
    w2 = _put(mesh, rng.standard_normal((hidden, hidden)) / 64, "bfloat16", P("tp", None))
    g = _put(mesh, rng.uniform(0.5, 1.5, hidden), "bfloat16", P())
    custom, ref = step("oneshot"), step("xla")
    steps = 10
    compiled = custom.lower(h, res, w1, w2, g).compile().as_text()
    assert "switchyard_oneshot" in compiled and "switchyard_fused_rmsnorm" in compiled
    assert "command_buffer" in compiled, "no command buffer formed"
    calls_before = native.host_calls()
    r1, n1 = res, h
    r2, n2 = res, h
    for i in range(steps):
        r1, n1 = custom(n1, r1, w1, w2, g)
        r2, n2 = ref(n2, r2, w1, w2, g)
        assert rel(_f64(r1), _f64(r2)) < 2e-2, i
        assert rel(_f64(n1), _f64(n2)) < 2e-2, i
    kernels.check_errors()
    handler_calls = native.host_calls() - calls_before
    print(f"handler invocations for {steps} steps x {world} GPUs x 2 custom calls: {handler_calls}")


def test_peer_that_never_arrives_times_out_and_is_reported(mesh: Mesh) -> None:
    """Launch a one-shot on GPU 0 alone: its barrier must give up (bounded wait), the error must
    be visible to the host without a sync, and the next call must refuse to run until reset()."""
    kernels.set_timeout(0.2)
    try:
        dev0 = mesh.devices.flat[0]
        x = jax.device_put(jnp.ones((1024,), jnp.float32), dev0)
        lone = jax.jit(lambda v: collectives._ffi_all_reduce("oneshot", v))
        lone(x).block_until_ready()
        with pytest.raises(kernels.KernelError):
            kernels.check_errors()
        with pytest.raises(Exception, match="never reached a barrier"):
            jax.jit(lambda v: collectives._ffi_all_reduce("twoshot", v) + 1)(x).block_until_ready()
    finally:
        kernels.reset(0)
        kernels.set_timeout(10.0)
    kernels.check_errors()
    world = mesh.devices.size
    fn = _allreduce_fn(mesh, "oneshot")
    xs = np.arange(world * 8, dtype=np.float32).reshape(world, 8)
    out = fn(_put(mesh, xs, "float32", P("tp")), _put(mesh, np.zeros((world, 8)), "float32", P("tp")))
    np.testing.assert_array_equal(np.asarray(out)[0], xs.sum(0))
