"""CPU tests of switchyard.kernels: reference semantics on simulated devices, strategy selection,
the staged (platform_dependent) kernel path, and that the CUDA sources compile."""

from __future__ import annotations

import ctypes
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels import build, native, selection
from switchyard.kernels.selection import Capability, build_table, choose, choose_fused, lookup

DTYPES = ("float32", "bfloat16", "float16")
TOL = {"float32": 1e-6, "bfloat16": 1e-2, "float16": 2e-3}


def _mesh(world: int) -> Mesh:
    return Mesh(np.array(jax.devices("cpu")[:world]), ("tp",))


@pytest.fixture
def fake_gpu_capability(monkeypatch: pytest.MonkeyPatch):
    """Pretend the kernels are available so the staged kernel branch is traced (CPU lowering still
    picks the reference branch: that is the property under test)."""

    def install(world: int) -> None:
        cap = Capability(True, world=world, oneshot_bytes=1 << 20, twoshot_bytes=1 << 24, reason="test")
        monkeypatch.setattr(native, "capability", lambda: cap)

    return install


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


def _reference(xs: np.ndarray, res: np.ndarray, w: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    s = xs.astype(np.float64).sum(axis=0)
    nr = res.astype(np.float64) + s
    normed = nr / np.sqrt(np.mean(nr * nr, axis=-1, keepdims=True) + eps)
    return nr, w.astype(np.float64) * normed


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("strategy", kernels.STRATEGIES)
@pytest.mark.parametrize("staged", [False, True], ids=["plain", "staged"])
def test_reference_semantics(world: int, strategy: str, staged: bool, fake_gpu_capability) -> None:
    """Every strategy, every dtype, on 2 and 4 CPU devices: the sum and the fused op match a
    float64 reference, and every shard holds the same bits."""
    if staged:
        fake_gpu_capability(world)
    mesh = _mesh(world)
    rng = np.random.default_rng(world * 100 + len(strategy))
    rows, hidden, eps = 3, 40, 1e-5

    def body(x, res, w):
        y = kernels.all_reduce(x[0], "tp", strategy)
        nr, normed = kernels.all_reduce_residual_rmsnorm(x[0], res, w, eps, "tp", strategy)
        return y[None], nr[None], normed[None]

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"),) * 3, check_vma=False
        )
    )
    for dtype in DTYPES:
        xs = rng.standard_normal((world, rows, hidden)).astype(np.float32)
        res = rng.standard_normal((rows, hidden)).astype(np.float32)
        w = rng.uniform(0.5, 1.5, hidden).astype(np.float32)
        args = [
            jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, spec))
            for a, spec in ((xs, P("tp")), (res, P()), (w, P()))
        ]
        xs_t, res_t, w_t = (np.asarray(a.astype(jnp.float32)) for a in args)
        y, nr, normed = (np.asarray(o) for o in f(*args))
        ref_nr, ref_normed = _reference(xs_t, res_t, w_t, eps)
        assert _rel_err(y[0], xs_t.astype(np.float64).sum(0)) < TOL[dtype], dtype
        assert _rel_err(nr[0], ref_nr) < TOL[dtype], dtype
        assert _rel_err(normed[0], ref_normed) < 2 * TOL[dtype], dtype
        for out in (y, nr, normed):
            for r in range(1, world):
                assert np.array_equal(out[r].view(np.uint8), out[0].view(np.uint8))


def test_staged_program_holds_kernel_branch_and_lowers_to_reference_on_cpu(fake_gpu_capability) -> None:
    fake_gpu_capability(2)
    mesh = _mesh(2)
    fn = jax.shard_map(
        lambda x: kernels.all_reduce(x, "tp", "oneshot"), mesh=mesh, in_specs=P("tp"), out_specs=P(), check_vma=False
    )
    x = jax.device_put(jnp.ones((4, 8), jnp.bfloat16), NamedSharding(mesh, P("tp")))
    jaxpr = str(jax.make_jaxpr(fn)(x))
    assert "switchyard_oneshot" in jaxpr and "psum" in jaxpr
    hlo = jax.jit(fn).lower(x).as_text()
    assert "switchyard" not in hlo  # CPU lowering never emits the CUDA custom call


def test_cuda_lowering_emits_the_custom_calls(fake_gpu_capability) -> None:
    """Cross-lower for CUDA on a CPU-only machine: each strategy becomes its FFI custom call, and
    the fused op one call with the eps attribute."""
    fake_gpu_capability(2)
    mesh = _mesh(2)

    def body(x, r, w):
        v, t0 = native.timestamp(x[0])
        v = kernels.all_reduce(kernels.all_reduce(v, "tp", "oneshot"), "tp", "twoshot")
        _, h = kernels.all_reduce_residual_rmsnorm(v, r, w, 1e-5, "tp", "oneshot")
        return t0[None], h[None]

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"),) * 2, check_vma=False)
    )
    specs = [
        jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
        for shape, spec in (((2, 4, 64), P("tp")), ((4, 64), P()), ((64,), P()))
    ]
    text = fn.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    for target in ("switchyard_timestamp", "switchyard_oneshot", "switchyard_twoshot", "switchyard_fused_rmsnorm"):
        assert f"custom_call @{target}" in text, target
    assert "eps = 9.99999974E-6" in text
    assert "all_reduce" not in text  # no psum left on the CUDA path


def test_split_product_sums_to_the_product() -> None:
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((3, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 7)), jnp.float32)
    parts = kernels.split_product(x, w, 4)
    assert parts.shape == (4, 3, 7) and parts.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(parts.sum(0)), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(parts[1]), np.asarray(x[:, 6:12]) @ np.asarray(w[6:12]), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="cannot split K = 24 into 5"):
        kernels.split_product(x, w, 5)


@pytest.mark.parametrize("staged", [False, True], ids=["plain", "staged"])
def test_partial_products_reduce_like_their_sum(staged: bool, fake_gpu_capability) -> None:
    """Partial products in place of x: the same result as passing their sum rounded to the residual's
    dtype, on every strategy's path; malformed partials are refused."""
    world = 2
    if staged:
        fake_gpu_capability(world)
    mesh = _mesh(world)
    rng = np.random.default_rng(8)
    parts = jnp.asarray(rng.standard_normal((world, 3, 2, 40)), jnp.float32)
    res = jnp.asarray(rng.standard_normal((2, 40)), jnp.bfloat16)
    w = jnp.asarray(rng.uniform(0.5, 1.5, 40), jnp.bfloat16)

    def run(strategy: str, summed: bool):
        def body(p, r, g):
            x = p[0].sum(0).astype(r.dtype) if summed else p[0]
            nr, normed = kernels.all_reduce_residual_rmsnorm(x, r, g, 1e-5, "tp", strategy)
            return nr[None], normed[None]

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"),) * 2,
                                   check_vma=False))
        return [np.asarray(o.astype(jnp.float32)) for o in fn(parts, res, w)]

    for strategy in ("xla", "oneshot", "auto"):
        for a, b in zip(run(strategy, False), run(strategy, True), strict=True):
            assert np.array_equal(a, b), strategy
    bad = [(jnp.ones((5, 2, 40), jnp.float32), "S <= 4"), (jnp.ones((2, 2, 40), jnp.bfloat16), "float32"),
           (jnp.ones((2, 3, 40), jnp.float32), "float32")]
    for x, match in bad:
        with pytest.raises(ValueError, match=match):
            kernels.all_reduce_residual_rmsnorm(x, res, w, 1e-5, "tp", "xla")


def test_cuda_lowering_hands_the_partials_to_the_fused_kernel(fake_gpu_capability) -> None:
    fake_gpu_capability(2)
    mesh = _mesh(2)

    def body(a, wo, r, g):
        _, h = kernels.all_reduce_residual_rmsnorm(kernels.split_product(a, wo, 4), r, g, 1e-5, "tp", "oneshot")
        return h[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P(), P()),
                               out_specs=P("tp"), check_vma=False))
    specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
             for shape, spec in (((2, 256), P(None, "tp")), ((256, 64), P("tp", None)), ((2, 64), P()), ((64,), P()))]
    text = fn.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @switchyard_fused_rmsnorm(%" in text
    call = next(ln for ln in text.splitlines() if "custom_call @switchyard_fused_rmsnorm" in ln)
    assert "tensor<4x2x64xf32>" in call, call


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_the_row_parallel_product_splits_k_from_two_rows(fake_gpu_capability, rows) -> None:
    """One row takes the plain product (XLA's batched one-row product copies the weight), two rows on
    the partial products; both into the fused kernel."""
    fake_gpu_capability(2)
    mesh = _mesh(2)

    def body(a, wo, r, g):
        _, h = kernels.row_parallel_residual_rmsnorm(a, wo, r, g, 1e-5, "tp", "oneshot")
        return h[None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P(), P()),
                               out_specs=P("tp"), check_vma=False))
    specs = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
             for shape, spec in (((rows, 256), P(None, "tp")), ((256, 64), P("tp", None)), ((rows, 64), P()),
                                 ((64,), P()))]
    text = fn.trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
    call = next(ln for ln in text.splitlines() if "custom_call @switchyard_fused_rmsnorm" in ln)
    expected = f"tensor<{rows}x64xbf16>" if rows < kernels.SPLIT_MIN_ROWS else f"tensor<4x{rows}x64xf32>"
    assert call.split("(")[1].startswith("%") and expected in call.split("->")[0], call


def test_engine_with_partial_products_decodes_like_xla(fake_gpu_capability) -> None:
    """TP=2 engine whose fused all-reduce takes partial products (staged; the reference runs on CPU):
    float32 logits equal those of the psum engine on the same weights."""
    from helpers.engine_fixtures import greedy_and_logits
    from switchyard.service.engine.engine import Engine, EngineConfig
    from switchyard.service.engine.step_policy import StepShape
    from switchyard.service.modelspec import ServingLayout, preset

    fake_gpu_capability(2)
    spec = preset("tiny")
    layout = ServingLayout(tp=2, batch_slots=2, max_seq_len=64)
    engines = [Engine.from_random(spec, layout, EngineConfig(batch_slots=2, max_seq_len=64, strategy=s, dtype="float32",
                                                             block_size=16, step_tokens=16),
                                  seed=3, devices=jax.devices("cpu")[:2])
               for s in ("oneshot", "xla")]
    first = engines[0]
    step = first._program("step", StepShape(2))
    text = step.trace(first.params, first._state, first._io).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @switchyard_fused_rmsnorm" in ln]
    assert len(calls) == 2 * spec.num_layers and all("tensor<4x2x128xf32>" in c for c in calls), calls[:1]
    (ta, la), (tb, lb) = (greedy_and_logits(e, [1, 5, 9, 13], 4) for e in engines)
    assert ta == tb
    np.testing.assert_allclose(la, lb, rtol=2e-5, atol=2e-5)


def test_check_vma_uses_reference_path(fake_gpu_capability) -> None:
    fake_gpu_capability(2)
    mesh = _mesh(2)
    fn = jax.shard_map(lambda x: kernels.all_reduce(x, "tp", "auto"), mesh=mesh, in_specs=P("tp"), out_specs=P())
    x = jax.device_put(jnp.ones((4, 8), jnp.float32), NamedSharding(mesh, P("tp")))
    assert "switchyard" not in str(jax.make_jaxpr(fn)(x))
    np.testing.assert_array_equal(np.asarray(jax.jit(fn)(x)), np.full((2, 8), 2.0))


def test_unknown_strategy_rejected() -> None:
    with pytest.raises(ValueError, match="unknown all-reduce strategy"):
        selection.check_strategy("nccl")


# ---- strategy selection (pure) ----------------------------------------------------------------
CAP2 = Capability(True, world=2, oneshot_bytes=1 << 20, twoshot_bytes=1 << 26, reason="test")
TABLE = {
    "allreduce": {"2": [[65536, "oneshot"], [4 << 20, "twoshot"], [None, "xla"]]},
    "fused": {"2": [[131072, "fused"], [None, "twoshot"]]},
}


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [(1, "oneshot"), (65536, "oneshot"), (65537, "twoshot"), (4 << 20, "twoshot"), ((4 << 20) + 1, "xla")],
)
def test_auto_follows_table(nbytes: int, expected: str) -> None:
    assert choose("auto", nbytes, 2, "bfloat16", CAP2, TABLE) == expected


def test_explicit_strategies_and_fallbacks() -> None:
    assert choose("xla", 1024, 2, "bfloat16", CAP2, TABLE) == "xla"
    assert choose("oneshot", 1024, 2, "bfloat16", CAP2, TABLE) == "oneshot"
    assert choose("twoshot", 1024, 2, "float16", CAP2, TABLE) == "twoshot"
    # one-shot too large for its workspace degrades to two-shot, then to xla
    assert choose("oneshot", (1 << 20) + 2, 2, "float32", CAP2, TABLE) == "twoshot"
    assert choose("twoshot", (1 << 26) + 2, 2, "float32", CAP2, TABLE) == "xla"
    # no library / P2P, a mesh axis that is not the registered group, a dtype we do not reduce
    assert choose("oneshot", 1024, 2, "bfloat16", Capability.unavailable("no p2p"), TABLE) == "xla"
    assert choose("oneshot", 1024, 4, "bfloat16", CAP2, TABLE) == "xla"
    assert choose("oneshot", 1024, 2, "int32", CAP2, TABLE) == "xla"
    assert choose("auto", 0, 2, "float32", CAP2, TABLE) == "xla"


def test_fused_selection() -> None:
    assert choose_fused("oneshot", 8192, 2, "bfloat16", CAP2, TABLE) == "fused"
    assert choose_fused("twoshot", 8192, 2, "bfloat16", CAP2, TABLE) == "twoshot"
    assert choose_fused("auto", 131072, 2, "bfloat16", CAP2, TABLE) == "fused"
    assert choose_fused("auto", 131073, 2, "bfloat16", CAP2, TABLE) == "twoshot"
    assert choose_fused("oneshot", (1 << 20) + 2, 2, "bfloat16", CAP2, TABLE) == "twoshot"
    assert choose_fused("xla", 8, 2, "bfloat16", CAP2, TABLE) == "xla"


def test_unmeasured_world_uses_default_rule() -> None:
    cap8 = Capability(True, world=8, oneshot_bytes=1 << 20, twoshot_bytes=1 << 26)
    assert choose("auto", 1024, 8, "bfloat16", cap8, TABLE) == "oneshot"
    assert choose("auto", 1 << 20, 8, "bfloat16", cap8, TABLE) == "twoshot"


def test_lookup_bounds() -> None:
    rules = [[10, "a"], [20, "b"]]
    assert [lookup(rules, n) for n in (1, 10, 11, 20, 21)] == ["a", "a", "b", "b", "xla"]


def test_build_table_from_rows() -> None:
    rows = []
    for size, times in {1024: (9, 3, 4), 65536: (12, 5, 6), 1 << 20: (30, 14, 11), 1 << 26: (300, 500, 350)}.items():
        for impl, us in zip(("xla", "oneshot", "twoshot"), times, strict=True):
            rows.append({"impl": impl, "gpus": 2, "bytes": size, "dtype": "bfloat16", "us": us})
    rows.append({"impl": "fused", "gpus": 2, "bytes": 1024, "dtype": "bfloat16", "us": 3})
    rows.append({"impl": "xla_norm", "gpus": 2, "bytes": 1024, "dtype": "bfloat16", "us": 20})
    table = build_table(rows, "test")
    assert table["sources"] == {"2": "test"}
    mid = int((65536 * (1 << 20)) ** 0.5)
    assert table["allreduce"]["2"] == [[mid, "oneshot"], [1 << 23, "twoshot"], [None, "xla"]]
    assert table["fused"]["2"] == [[None, "fused"]]
    cap = Capability(True, world=2, oneshot_bytes=1 << 27, twoshot_bytes=1 << 27)
    assert [choose("auto", n, 2, "bfloat16", cap, table) for n in (1024, 65536, 1 << 20, 1 << 26)] == [
        "oneshot",
        "oneshot",
        "twoshot",
        "xla",
    ]


def test_a_run_on_one_gpu_count_keeps_the_rules_of_the_others() -> None:
    shipped = {"sources": {"2": "two.json", "4": "four.json"},
               "allreduce": {"2": [[None, "oneshot"]], "4": [[None, "xla"]]}, "fused": {"2": [[None, "fused"]]}}
    rows = [{"impl": impl, "gpus": 4, "bytes": 1024, "dtype": "bfloat16", "us": us}
            for impl, us in (("xla", 9), ("oneshot", 3), ("twoshot", 4), ("fused", 5), ("xla_norm", 20))]
    merged = selection.merge_tables(shipped, build_table(rows, "four-again.json"))
    assert merged["sources"] == {"2": "two.json", "4": "four-again.json"}
    assert merged["allreduce"] == {"2": [[None, "oneshot"]], "4": [[None, "oneshot"]]}
    assert merged["fused"] == {"2": [[None, "fused"]], "4": [[None, "fused"]]}
    cap4 = Capability(True, world=4, oneshot_bytes=1 << 27, twoshot_bytes=1 << 27)
    assert choose("auto", 1024, 4, "bfloat16", cap4, merged) == "oneshot"


def test_shipped_table_is_valid() -> None:
    table = json.loads(selection.TABLE_PATH.read_text())
    assert set(table["sources"]) == set(table["allreduce"]) == set(table["fused"])
    for source in table["sources"].values():
        assert (selection.TABLE_PATH.parents[1] / source).is_file()
    for kind, impls in (("allreduce", selection.PLAIN_IMPLS), ("fused", selection.FUSED_IMPLS)):
        for world, rules in table[kind].items():
            assert int(world) >= 2
            assert rules and rules[-1][0] is None
            assert all(impl in impls for _, impl in rules)
            bounds = [b for b, _ in rules[:-1]]
            assert bounds == sorted(bounds)


# ---- native layer without a GPU -----------------------------------------------------------------
def test_init_without_gpu_is_unavailable_not_an_error() -> None:
    cap = kernels.init(devices=jax.devices("cpu")[:2])
    assert not cap.available and "no GPU" in cap.reason
    kernels.check_errors()  # nothing to report
    assert kernels.status()["available"] is False


def test_a_second_device_list_in_one_process_is_refused_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels keep the first group's workspaces for the process's life: a group on other GPUs
    is an error naming both lists, never a quiet fall back to psum (the library itself is not reached)."""

    class Gpu:
        platform, process_index = "gpu", 0

        def __init__(self, ordinal: int) -> None:
            self.local_hardware_id = ordinal

    monkeypatch.setattr(native, "load", lambda: object())
    monkeypatch.setattr(native._state, "ordinals", [0, 1])
    with pytest.raises(kernels.KernelError, match=r"^the kernels serve GPUs \[0, 1\] in this process; a "
                       r"tensor-parallel group on GPUs \[0, 1, 2, 3\] needs a process of its own$"):
        kernels.init([Gpu(i) for i in range(4)])


def test_a_library_is_built_again_only_when_what_it_is_built_from_changes(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """An nvcc that counts its compiles (CUDA_HOME/bin/nvcc): the same build twice compiles once; other
    flags, or a library whose record of its inputs is gone, compile again."""
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "calls"
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(f"""#!/bin/sh
[ "$1" = --version ] && {{ echo "nvcc: fake 1.0"; exit 0; }}
echo compile >> {calls}
while [ "$1" != -o ]; do shift; done
echo library > "$2"
""")
    nvcc.chmod(0o755)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    out = tmp_path / "lib" / build.LIB_NAME

    def compiles() -> int:
        return len(calls.read_text().splitlines()) if calls.exists() else 0

    assert build.build(out, gencode=CI_GENCODE) == out and out.read_text() == "library\n" and compiles() == 1
    build.build(out, gencode=CI_GENCODE)
    assert compiles() == 1  # nothing changed
    build.build(out)  # the product's two targets
    assert compiles() == 2
    out.with_name(out.name + ".inputs").unlink()
    build.build(out)
    assert compiles() == 3


# ---- the CUDA code compiles ---------------------------------------------------------------------
# The diagnostic build as PTX (nvcc's front end and NVVM, not ptxas): a third less time, and the
# product build beside it is compiled to sm_90a machine code in full.
CI_GENCODE = ("-gencode=arch=compute_90a,code=compute_90a",)
C_API = ("sy_last_error", "sy_init", "sy_error", "sy_reset", "sy_device_calls", "sy_host_calls",
         "sy_set_timeout_ns", "sy_oneshot_bytes", "sy_twoshot_bytes", "sy_is_ready", "sy_world",
         "sy_preload_attention", "sy_device_memory")
DIAGNOSTIC_SYMBOLS = (*native.DIAGNOSTIC_TARGETS.values(), "sy_phase_read")


@pytest.fixture(scope="module")
def libraries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CI has nvcc but no GPU: the product library as installed (built again only if its sources,
    nvcc or JAX changed since: ``build.inputs_digest``) and the phase-timer diagnostic build."""
    if build.find_nvcc() is None:
        pytest.skip("nvcc not on PATH")
    tmp = tmp_path_factory.mktemp("kernels")
    timed = build.build(tmp / "timed.so", gencode=CI_GENCODE, defines=(build.PHASE_TIMER,))
    return {"product": build.build(), "phase_timer": timed}


def exported(lib: Path) -> set[str]:
    """The library's own exported functions and handlers (nm -D; the C++ runtime's weak symbols aside)."""
    import subprocess

    listing = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in listing.stdout.splitlines() if line.split()[-1].startswith(("Sy", "sy_"))}


def test_cuda_sources_compile(libraries: dict[str, Path]) -> None:
    """The library exports every FFI handler and the C API (and loads without a driver)."""
    out = libraries["product"]
    lib = ctypes.CDLL(str(out))  # static CUDA runtime: loads without a driver
    for symbol in (*native.TARGETS.values(), "sy_init", "sy_error", "sy_reset", "sy_device_calls"):
        assert hasattr(lib, symbol), symbol
    if shutil.which("cuobjdump"):
        import subprocess

        listing = subprocess.run(["cuobjdump", "--list-elf", str(out)], capture_output=True, text=True).stdout
        assert "sm_90a" in listing


def test_the_device_memory_query_says_why_it_cannot_answer(libraries: dict[str, Path]) -> None:
    """Where no GPU answers (CI), or for an ordinal out of range, the query fails with a reason and
    leaves its outputs alone."""
    lib = ctypes.CDLL(str(libraries["product"]))
    u64 = ctypes.c_ulonglong
    lib.sy_device_memory.argtypes = [ctypes.c_int, ctypes.POINTER(u64), ctypes.POINTER(u64)]
    lib.sy_last_error.restype = ctypes.c_char_p
    free, total = u64(7), u64(7)
    assert lib.sy_device_memory(-1, ctypes.byref(free), ctypes.byref(total)) == 1
    assert lib.sy_last_error() == b"device memory: bad device ordinal"
    if lib.sy_device_memory(0, ctypes.byref(free), ctypes.byref(total)) == 0:  # a GPU answered
        assert 0 < free.value <= total.value
    else:
        assert lib.sy_last_error().startswith(b"cudaMemGetInfo: ")
        assert free.value == total.value == 7


@pytest.mark.skipif(shutil.which("nm") is None, reason="nm not on PATH")
def test_diagnostics_are_only_in_the_diagnostic_build(libraries: dict[str, Path]) -> None:
    product = exported(libraries["product"])
    assert product == {*native.TARGETS.values(), *C_API}
    assert not product & set(DIAGNOSTIC_SYMBOLS)
    assert exported(libraries["phase_timer"]) == product | set(DIAGNOSTIC_SYMBOLS)


def test_phase_timer_build_compiles_and_normal_builds_have_no_timers(libraries: dict[str, Path], monkeypatch) -> None:
    """The diagnostic build (benchmarks/kernel_phases.py) compiles; with a normal build the phase
    timers answer that there are none, without touching a GPU."""
    timed = ctypes.CDLL(str(libraries["phase_timer"]))
    assert hasattr(timed, "sy_phase_read") and hasattr(timed, "SyTimestamp")
    plain = ctypes.CDLL(str(libraries["product"]))
    native._declare(plain)
    monkeypatch.setattr(native, "load", lambda: plain)
    assert native.phase_counters(0) is None


def test_phase_timer_build_needs_its_own_output_path() -> None:
    with pytest.raises(SystemExit):  # never over the installed library
        build.main(["--phase-timer"])
    with pytest.raises(build.BuildError, match="own output path"):  # nor over the benchmarks' diagnostic one
        build.build(defines=(build.PHASE_TIMER,))
    timed = build.nvcc_command("nvcc", Path("x.so"), defines=("SWITCHYARD_PHASE_TIMER",))
    assert "-DSWITCHYARD_PHASE_TIMER" in timed
    # The timers' reader is a diagnostic source: a phase-timer build is a diagnostic build.
    assert "-DSWITCHYARD_DIAGNOSTICS" in timed and any(a.endswith("/ffi_diagnostics.cu") for a in timed)
    product = build.nvcc_command("nvcc", Path("x.so"))
    assert not any("SWITCHYARD" in a or a.endswith("/ffi_diagnostics.cu") for a in product)
    assert [a for a in product if a.endswith(".cu")] == [str(build.CSRC / s) for s in build.SOURCES]
    diagnostic = build.nvcc_command("nvcc", Path("x.so"), diagnostics=True)
    assert "-DSWITCHYARD_DIAGNOSTICS" in diagnostic and "-DSWITCHYARD_PHASE_TIMER" not in diagnostic


def test_missing_table_falls_back_to_default_rule(tmp_path) -> None:
    table = selection.load_table(tmp_path / "absent.json")
    assert table == {}
    assert choose("auto", 1024, 2, "bfloat16", CAP2, table) == "oneshot"
