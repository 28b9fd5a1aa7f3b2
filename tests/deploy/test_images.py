"""The Dockerfiles, checked without a container engine: their entry points are commands the real CLI
parser accepts and that the chart and the renderer run; users match the pods' securityContext; base
images and Python packages are pinned (hash-locked, from pyproject.toml); and the operator image's
packages are enough to run the operator and plan, with no JAX. test_image_install.py builds each
image's Python layer as its Dockerfile does."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers.chart_helpers import ROOT, one, template
from helpers.dockerfile import IMAGES, final_stage, instructions
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from switchyard.cli import operator as operator_main
from switchyard.cli import serve as serve_cli
from switchyard.cli.main import build_parser
from switchyard.operator import render

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def argv_of(path: Path) -> list[str]:
    stage = final_stage(path)
    # Exec form only: a shell form would put /bin/sh -c in front and drop signals (SIGTERM drains).
    return json.loads(stage["ENTRYPOINT"]) + json.loads(stage["CMD"])


def lock(image: str) -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==(\S+) \\\n\s+--hash=sha256:[0-9a-f]{64}$",
                      (IMAGES / image / "requirements.lock").read_text(), flags=re.M)
    return {canonicalize_name(name): version for name, version in pins}


# ---- entry points -----------------------------------------------------------------------------------
def test_operator_image_runs_the_operator_as_the_chart_does():
    argv = argv_of(IMAGES / "operator" / "Dockerfile")
    assert argv == ["switchyard", "operator"]
    assert build_parser().parse_args(argv[1:])._run is operator_main.run
    pod = one(template(), "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # The chart names the same program and subcommand, then adds its arguments.
    assert container["command"] == argv
    user, _, group = final_stage(IMAGES / "operator" / "Dockerfile")["USER"].partition(":")
    assert (int(user), int(group)) == (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"])


def test_service_image_runs_serve_as_the_renderer_does():
    path = IMAGES / "service" / "Dockerfile"
    argv = argv_of(path)
    assert argv[:2] == ["switchyard", "serve"]
    assert build_parser().parse_args(argv[1:])._run is serve_cli.run
    stage = final_stage(path)
    config = render.RenderConfig()
    user, _, group = stage["USER"].partition(":")
    assert int(user) == int(group) == config.run_as_user
    assert stage["EXPOSE"] == str(config.port)


def test_rendered_serving_command_is_what_the_cli_parses():
    """The StatefulSet's command, for every engine-independent part, is accepted by `switchyard serve`
    and means what the renderer intends."""
    from helpers.kube.harness import decode_service, gpu_node
    from switchyard.operator import inventory, planner
    from switchyard.operator import spec as specmod

    body = decode_service()
    body["metadata"].update(uid="uid-1", generation=1)
    spec = specmod.normalized(body["spec"])
    plan = planner.plan(specmod.model_spec(spec), inventory.build([gpu_node("h200-0")], []), specmod.request(spec))
    sts = next(o for o in render.render(body, spec, plan, specmod.model_source(spec)) if o["kind"] == "StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[0] == argv_of(IMAGES / "service" / "Dockerfile")[0]
    args = build_parser().parse_args(command[1:])
    assert args._run is serve_cli.run
    assert (args.layout, args.port) == (render.LAYOUT_FILE, container["ports"][0]["containerPort"])
    assert args.model_path == specmod.model_source(spec).path
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_entry_points_use_exec_form():
    for image in ("operator", "service"):
        stage = final_stage(IMAGES / image / "Dockerfile")
        for key in ("ENTRYPOINT", "CMD"):
            assert stage[key].startswith("["), f"{image} {key} is in shell form"


# ---- pins ---------------------------------------------------------------------------------------------
def test_base_images_are_pinned():
    for image in ("operator", "service"):
        text = (IMAGES / image / "Dockerfile").read_text()
        bases = re.findall(r"^ARG \w+_IMAGE=(\S+)$", text, flags=re.M)
        assert bases, image
        for base in bases:
            tag = base.rpartition(":")[2]
            # A full version (x.y.z...), never latest or a moving major tag.
            assert re.match(r"\d+\.\d+\.\d+", tag), f"{image}: base {base} is not pinned to a release"


def test_images_install_only_hash_locked_packages():
    for image in ("operator", "service"):
        runs = [rest for word, rest in instructions(IMAGES / image / "Dockerfile") if word == "RUN"]
        installs = [seg for r in runs for seg in r.split("&&") if "pip install" in seg]
        locked = [s for s in installs if "--require-hashes" in s]
        assert len(locked) == 1 and "-r /tmp/requirements.lock" in locked[0] and "--no-deps" in locked[0]
        # Everything else installs our own wheel without resolving dependencies, or pins build tools.
        for seg in installs:
            if seg in locked:
                continue
            assert "--no-deps" in seg or all("==" in a for a in re.findall(r'"([^"]+)"', seg)), seg


def requirement_met(req: str, pins: dict[str, str]) -> None:
    r = Requirement(req)
    name = canonicalize_name(r.name)
    assert name in pins, f"{r.name} is not in the lock"
    assert r.specifier.contains(pins[name], prereleases=True), f"{r.name}=={pins[name]} does not satisfy {req}"
    for extra in r.extras:  # e.g. jax[cuda13]: the extra's own requirements are locked too
        for sub in importlib.metadata.requires(r.name) or []:
            sub_req = Requirement(sub)
            if sub_req.marker and sub_req.marker.evaluate({**default_environment(), "extra": extra}) \
                    and not sub_req.marker.evaluate({**default_environment(), "extra": ""}):
                assert canonicalize_name(sub_req.name) in pins, f"{sub_req.name} (from {req}) is not in the lock"


def own_extras(req: str) -> list[str]:
    """The extras a requirement on switchyard itself names (``switchyard[serve]``), else []."""
    r = Requirement(req)
    return sorted(r.extras) if canonicalize_name(r.name) == canonicalize_name(PROJECT["name"]) else []


def extra_requirements(name: str) -> list[str]:
    """An extra's requirements, with those of the extras of ours it names."""
    out: list[str] = []
    for req in PROJECT["optional-dependencies"][name]:
        out += [r for sub in own_extras(req) for r in extra_requirements(sub)] if own_extras(req) else [req]
    return out


def test_operator_lock_is_the_base_and_operator_extra_and_has_no_jax():
    pins = lock("operator")
    for req in [*PROJECT["dependencies"], *extra_requirements("operator")]:
        requirement_met(req, pins)
    heavy = {"jax", "jaxlib", "numpy", "grpcio", "torch", "safetensors", "matplotlib", "opentelemetry-sdk"}
    assert not heavy & set(pins), heavy & set(pins)


def test_the_base_needs_no_serving_package():
    """What the operator image holds beside its extra is the base: none of the serving stack may be
    there, or the image's `pip check` fails (its lock has the operator extra and the base only)."""
    base = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    serving = {canonicalize_name(Requirement(r).name) for r in extra_requirements("serve")}
    assert not base & serving, base & serving
    assert "jax" in serving and "grpcio" in serving


def test_service_lock_covers_the_base_and_gpu_dependencies():
    pins = lock("service")
    assert own_extras(PROJECT["optional-dependencies"]["gpu"][0]) == ["serve"]
    for req in [*PROJECT["dependencies"], *extra_requirements("gpu")]:
        requirement_met(req, pins)
    # JAX, its compiler and its CUDA plugin move together.
    assert pins["jax"] == pins["jaxlib"] == pins["jax-cuda13-plugin"] == pins["jax-cuda13-pjrt"]


def test_locks_are_closed_under_dependencies():
    """Installed with --no-deps, a lock must hold every dependency of what it holds. Checked from the
    metadata of each locked package that is installed here at the locked version."""
    env = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.8",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}
    checked = 0
    for image in ("operator", "service"):
        pins = lock(image)
        for name, version in pins.items():
            try:
                dist = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            if dist.version != version:
                continue
            checked += 1
            for raw in dist.requires or []:
                req = Requirement(raw)
                if req.marker is None or req.marker.evaluate(env):
                    assert canonicalize_name(req.name) in pins, f"{image}: {name} needs {req.name}, not locked"
    assert checked >= 20, "too few locked packages are installed here to check the locks"


# ---- the operator image's packages are enough -----------------------------------------------------------
BLOCKER = r'''
import sys
allowed = set(sys.argv[1].split(","))


class Only:
    # Wraps each import finder: modules outside the image's packages are simply not found, as in the
    # image (importlib.util.find_spec answers None, import raises ModuleNotFoundError).
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in allowed or top in sys.stdlib_module_names or top.startswith("_"):
            return self.finder.find_spec(name, path, target)
        return None

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Only(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
sys.argv = ["switchyard", *sys.argv[2:]]
import runpy
runpy.run_module("switchyard.cli.main", run_name="__main__")
'''


def operator_image_modules() -> list[str]:
    """Top-level modules of the operator lock's distributions (as installed here), plus ours."""
    pins = set(lock("operator"))
    tops = {"switchyard"}
    for top, dists in importlib.metadata.packages_distributions().items():
        if any(canonicalize_name(d) in pins for d in dists):
            tops.add(top)
    return sorted(tops)


def run_as_in_operator_image(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCKER, ",".join(operator_image_modules()), *args],
                          capture_output=True, text=True, timeout=60)


def test_operator_runs_with_only_the_operator_images_packages():
    proc = run_as_in_operator_image("operator", "--help")
    assert proc.returncode == 0 and "--peering" in proc.stdout, proc.stderr
    proc = run_as_in_operator_image("plan", "--model", "llama3-8b", "--nodes",
                                    str(ROOT / "manifests" / "nodes" / "hgx-h100.yaml"), "--objective", "latency")
    assert proc.returncode == 0 and "Planned: TP" in proc.stdout, proc.stderr
    # Everything `switchyard operator` imports before it connects: handlers, planner, renderer, kopf.
    code = "import switchyard.operator.handlers, switchyard.operator.runner, kopf, kubernetes"
    proc = subprocess.run([sys.executable, "-c", BLOCKER.replace(
        'import runpy\nrunpy.run_module("switchyard.cli.main", run_name="__main__")', code),
        ",".join(operator_image_modules())], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_blocker_blocks():
    # The check above would pass vacuously if nothing were blocked: JAX must not import, and serving
    # says in one line which extra it needs.
    proc = run_as_in_operator_image("serve", "--tiny", "--port", "1")
    assert proc.returncode == 2 and "module 'jax' is not installed" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and "pip install 'switchyard[serve]'" in proc.stderr


@pytest.mark.parametrize("image", ["operator", "service"])
def test_dockerfile_copies_what_exists(image):
    for word, rest in instructions(IMAGES / image / "Dockerfile"):
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _dest = rest.split()
            for src in sources:
                assert (ROOT / src).exists(), f"{image}: COPY {src} does not exist"
