"""Setting up the GPU libraries before step programs compile side by side: nothing to do on host
devices; on a GPU, the small cuBLAS and cuDNN program compiles and runs on every GPU of the mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from switchyard.service.engine import gpu_libraries


def test_host_devices_have_no_libraries_to_set_up():
    assert gpu_libraries.set_up(Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))) is None


@pytest.mark.gpu
def test_the_libraries_program_runs_on_every_gpu():
    mesh = Mesh(np.array(jax.devices("gpu")), ("tp",))
    seconds = gpu_libraries.set_up(mesh)
    assert seconds is not None and seconds > 0

