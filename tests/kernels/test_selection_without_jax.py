"""The strategy chooser is the engine's and the operator's: it imports where JAX is absent (the
operator's image), as the model families the planner prices do, and the strategies are defined once,
in it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from switchyard import kernels
from switchyard.kernels import selection
from switchyard.service import modelspec

WITHOUT_JAX = textwrap.dedent("""
    import sys

    class NoJax:
        def find_spec(self, name, path=None, target=None):
            if name == "jax" or name.startswith(("jax.", "jaxlib")):
                raise ImportError(f"{name} is blocked: the operator's image has no JAX")
            return None

    sys.meta_path.insert(0, NoJax())
    try:
        import jax  # noqa: F401
    except ImportError:
        pass
    else:
        raise SystemExit("the blocker let jax in")
    from switchyard.kernels import selection
    from switchyard.operator import calibration, planner  # noqa: F401
    from switchyard.service import model, modelspec

    assert modelspec.STRATEGIES is selection.STRATEGIES
    # The families price their tensors for the planner without JAX.
    assert set(model.FAMILIES) == {"llama", "mistral", "qwen2", "qwen3"}
    assert modelspec.preset("qwen2.5-7b").param_count == 7_615_616_512
    cap = selection.Capability.node_group(2)
    assert selection.choose_fused("oneshot", 8192, 2, "bfloat16", cap) == "fused"
    assert calibration.load().engine_allreduce(8192, 2, nvswitch=True)[0] == "fused"
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "jaxlib", "numpy"))
    assert not loaded, loaded
    print("ok")
""")


def test_chooser_planner_modelspec_and_families_import_without_jax() -> None:
    proc = subprocess.run([sys.executable, "-P", "-c", WITHOUT_JAX], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_strategies_are_defined_once() -> None:
    assert modelspec.STRATEGIES is selection.STRATEGIES
    assert kernels.STRATEGIES is selection.STRATEGIES


def test_the_package_names_still_resolve() -> None:
    from switchyard.kernels import attention, collectives, native

    assert kernels.all_reduce is collectives.all_reduce
    assert kernels.all_reduce_residual_rmsnorm is collectives.all_reduce_residual_rmsnorm
    assert kernels.split_product is collectives.split_product
    assert kernels.init is native.init and kernels.KernelError is native.KernelError
    assert kernels.attention is attention
    assert set(kernels.__all__) <= set(dir(kernels))
    for name in kernels.__all__:
        assert getattr(kernels, name) is not None
