"""Each image's Python layer, built the way its Dockerfile builds it (tests/helpers/image_layer.py): a
fresh virtual environment of the images' Python (3.12, as the lock says), every COPY, ENV, WORKDIR and
RUN line of the Dockerfile as written, with wheels from the package index: our wheel built from the
copied sources, the whole hash-locked requirements.lock installed with ``--require-hashes --no-deps``,
``pip check``, then the image's command from that environment.

Exercised: that every locked file exists on the index with the locked hash and installs on CPython 3.12
on linux x86_64 (for the service image that includes JAX's CUDA 13 plugin and NVIDIA's CUDA wheels:
about 3 GB downloaded and 4.6 GB installed; on a 2-core machine the lock's install alone took 77 s, and
the service layer 4 minutes with its removal while other tests ran beside it), that the lock is closed
under dependencies as ``pip check`` sees them (the operator image: with no JAX at all), that our wheel
builds from exactly what the Dockerfile copies, and that `switchyard operator --help`, `switchyard plan`
and `switchyard serve --help` start from the installed layer.

Not exercised: the base images themselves (their operating system packages, their exact Python patch
release: here a fresh virtual environment of this machine's 3.12), the service image's CUDA kernel build
(``python -m switchyard.kernels.build`` needs the image's nvcc, and nvcc is kept off PATH here so the
install's own build hook skips it as well), anything that needs a GPU (no JAX program runs), and the
final stages' USER, EXPOSE and file ownership (tests/deploy/test_images.py checks those statically)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT
from helpers.dockerfile import IMAGES
from helpers.image_layer import NOT_RUN, Layer, build, images_python

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
EXAMPLE_NODES = ROOT / "manifests" / "nodes" / "hgx-h100.yaml"


def python_version(image: str) -> str:
    header = (IMAGES / image / "requirements.lock").read_text().splitlines()[1]
    return re.search(r"CPython (\d+\.\d+)", header).group(1)


@pytest.fixture(scope="module", params=["operator", "service"])
def layer(request: pytest.FixtureRequest) -> Iterator[Layer]:
    image = request.param
    version = python_version(image)
    python = images_python(version)
    if python is None:
        message = f"no CPython {version} on this machine (the {image} image's Python)"
        if os.environ.get("CI"):
            pytest.fail(message)  # CI must build the layers, never skip them
        pytest.skip(message)
    # Not pytest's tmp_path: it keeps the last runs' folders, and the service layer is gigabytes.
    with tempfile.TemporaryDirectory(prefix=f"switchyard-{image}-layer-") as scratch:
        yield build(image, Path(scratch), python)


def test_the_layer_is_built_from_every_python_step_of_the_dockerfile(layer: Layer) -> None:
    # Only operating-system packages and the CUDA kernel build were left out.
    for line in layer.not_run:
        assert sum(bool(re.search(pattern, line)) for pattern, _ in NOT_RUN) == 1, line
    assert any("kernels.build" in line for line in layer.not_run) == (layer.image == "service")
    # Our wheel, installed into the image's Python: not this checkout, not an editable link.
    done = layer.run("python", "-c", "import switchyard.cli.main as m; print(m.__file__)")
    assert done.returncode == 0, done.stderr[-3000:]
    module = Path(done.stdout.strip())
    assert module.is_relative_to(layer.root) and "site-packages" in module.parts, module


def test_the_image_command_starts_from_the_layer(layer: Layer) -> None:
    image = layer.image
    check = layer.run("pip", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    listed = layer.run("pip", "list", "--format=freeze").stdout
    if image == "operator":
        done = layer.run("switchyard", "operator", "--help")
        assert done.returncode == 0 and "--peering" in done.stdout, done.stderr[-3000:]
        done = layer.run("switchyard", "plan", "--model", "llama3-8b", "--nodes", str(EXAMPLE_NODES))
        assert done.returncode == 0 and "Planned: TP" in done.stdout, done.stdout + done.stderr[-3000:]
        assert not re.search(r"^(jax|jaxlib|numpy|grpcio)==", listed, flags=re.M), listed
        # The serving commands say which extra they need, in one line.
        done = layer.run("switchyard", "serve", "--tiny")
        assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr[-3000:]
        assert "pip install 'switchyard[serve]'" in done.stderr, done.stderr
    else:
        done = layer.run("switchyard", "serve", "--help")
        assert done.returncode == 0 and "--model-path" in done.stdout, done.stderr[-3000:]
        assert re.search(r"^jax-cuda13-plugin==", listed, flags=re.M), listed
