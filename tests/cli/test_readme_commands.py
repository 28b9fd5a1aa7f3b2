"""Every shell command in README.md, exercised as written: the commands are read from the README's
```sh / ```bash / ```shell / ```console blocks (never copied here), and each is run or checked as
CHECKS says. A README command that no row of CHECKS matches fails the first test, so a new command
cannot go unchecked.

What the README leaves to the reader (their model folder, the address of their server, a request id)
is swapped for a test value only where a command is run."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import HELPERS, ROOT
from helpers.serve_process import free_port
from helpers.serving_harness import serving, tiny_dir

pytestmark = pytest.mark.timeout(300)
README = (ROOT / "README.md").read_text()
SHELLS = ("sh", "bash", "shell", "console")
K8S_VERSION = "1.29.0"  # the oldest Kubernetes the README supports
EXAMPLE_NODES = HELPERS / "kube" / "nodes-hgx.yaml"
EXAMPLES = ROOT / "manifests" / "examples"
CRDS = ROOT / "charts" / "switchyard" / "crds"


@dataclasses.dataclass(frozen=True)
class Command:
    block: int  # which shell block of the README
    line: str  # the logical line as written (continuations joined)
    env: dict[str, str]  # NAME=value words before the program
    argv: list[str]  # the program and its arguments, without a trailing "&"

    @property
    def text(self) -> str:
        return " ".join(self.argv)


def readme_commands(readme: str = README) -> list[Command]:
    """Each command of each shell block: continuations joined, comments dropped except for an
    alternative given as "# or: COMMAND"; in a console block only the lines after a "$ " prompt."""
    blocks = re.findall(rf"^```({'|'.join(SHELLS)})\n(.*?)^```", readme, flags=re.S | re.M)
    commands = []
    for index, (language, body) in enumerate(blocks):
        for line in body.replace("\\\n", " ").splitlines():
            if language == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            line, _, alternative = line.partition("# or:")
            for text in (line, alternative):
                words = shlex.split(text, comments=True)
                env = {}
                while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
                    name, _, value = words.pop(0).partition("=")
                    env[name] = value
                if words and words[-1] == "&":
                    words.pop()
                if words:
                    commands.append(Command(index, text.strip(), env, words))
    return commands


COMMANDS = readme_commands()


def earlier_in_block(command: Command, pattern: str) -> list[Command]:
    before = COMMANDS[: COMMANDS.index(command)]
    return [c for c in before if c.block == command.block and re.fullmatch(pattern, c.text)]


def repo_path(name: str, what: str) -> Path:
    path = ROOT / name
    assert path.exists(), f"{what} {name!r} does not exist in the repository"
    return path


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


# ---- checks of commands that cannot run here -----------------------------------------------------------


def make_dry_run(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target exists and make reads its recipe (-n: nothing runs); every `switchyard` command the
    recipe runs parses with the CLI's parser."""
    from switchyard.cli.main import build_parser

    done = subprocess.run(["make", "-n", *command.argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for line in done.stdout.splitlines():
        words = shlex.split(line)
        if words and Path(words[0]).name == "switchyard":
            build_parser().parse_args(words[1:])


def module_help(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that needs nvcc: the module exists and its argument parser takes the command's words."""
    assert command.argv[:2] == ["python", "-m"], command.text
    done = subprocess.run([sys.executable, *command.argv[1:], "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-2000:]


def parsed_cli(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Too big for CI (GPUs, gigabytes, fixed ports): the CLI's own parser takes the words, in the
    command's environment and in a folder where the block's earlier `echo ... > FILE` lines ran, and the
    checks the subcommand makes before its slow part pass."""
    from switchyard.cli import serve as serve_cli
    from switchyard.cli.main import build_parser

    monkeypatch.chdir(tmp_path)
    for writer in earlier_in_block(command, ECHO):
        run_shell(writer, tmp_path)
    for name in [n for n in os.environ if n.startswith("SWITCHYARD_")]:
        monkeypatch.delenv(name)
    for name, value in command.env.items():
        monkeypatch.setenv(name, value)
    try:
        args = build_parser().parse_args(command.argv[1:])  # reads SWITCHYARD_* defaults now
    except SystemExit as err:
        pytest.fail(f"`{command.text}` does not parse (exit {err.code})")
    assert args.command == "serve", f"no parse check for `switchyard {args.command}`"
    layout = serve_cli.resolve_layout(args)
    if "SWITCHYARD_PIPELINE_STAGE" in command.env:
        assert layout.pp > 1 and layout.pipeline_stage == int(command.env["SWITCHYARD_PIPELINE_STAGE"])
        assert layout.coordinator, "a pipeline layout needs its coordinator"


ECHO = r"echo .+ > \S+"


def command_environment(command: Command) -> dict[str, str]:
    """This machine's environment as a reader's shell has it (no test settings of JAX or ours), with the
    command's own NAME=value words."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SWITCHYARD_") and k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    return {**env, "PYTHONSAFEPATH": "1", **command.env}


def switchyard_process(argv: list[str], command: Command, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "switchyard.cli.main", *argv], text=True,
                            env=command_environment(command), **kwargs)


def checkpoint_size_first(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as written into a scratch folder (the reader's /models) and stopped at its first line, which
    says how many bytes it is about to write and where, before any weight file exists."""
    from switchyard.service.modelspec import preset
    from switchyard.service.progress import format_bytes

    argv = command.argv[1:]
    out = tmp_path / Path(argv[argv.index("--out") + 1]).name
    argv[argv.index("--out") + 1] = str(out)
    proc = switchyard_process(argv, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = proc.stdout.readline()
        weights = list(out.glob("*.safetensors"))
    finally:
        proc.kill()
        error = proc.communicate(timeout=60)[1]
    size = format_bytes(preset(argv[argv.index("--preset") + 1]).param_bytes)
    if not first:  # a disk too small for it: refused in one line, with the same figures
        assert proc.returncode == 2 and size in error and "free" in error, error[-3000:]
        return
    assert first.startswith("writing ") and size in first and str(out) in first, first
    assert not weights, weights


def serve_until_listening(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as written in the reader's environment, on free ports (the README's are 8001 and 8000): it gets past
    its start-up checks (the devices it asks for included) to listening, then Ctrl-C stops it. Its log
    up to then holds no warning and none of JAX's notices that a TPU is missing."""
    ports = [free_port(), free_port()]
    proc = switchyard_process([*command.argv[1:], "--host", "127.0.0.1", "--port", str(ports[0]),
                               "--http-port", str(ports[1])], command, stderr=subprocess.PIPE)
    log = []
    try:
        for line in proc.stderr:
            log.append(line)
            if "listening on" in line:
                break
        started = "".join(log)
        proc.send_signal(signal.SIGINT)
        log.append(proc.communicate(timeout=120)[1])
    finally:
        proc.kill()
    assert proc.returncode in (0, 130) and "listening on" in started, "".join(log)[-3000:]
    assert " WARNING " not in started and "Unable to initialize backend" not in started, started[-3000:]


def run_shell(command: Command, tmp_path: Path) -> None:
    done = subprocess.run(["bash", "-c", command.line], cwd=tmp_path, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def written_layout(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run in a scratch folder: the file it writes is a layout `switchyard serve --layout` accepts."""
    from switchyard.service.modelspec import ServingLayout

    run_shell(command, tmp_path)
    layout = ServingLayout.from_json((tmp_path / command.argv[-1]).read_text())
    assert layout.pp >= 1


def docker_build(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its Dockerfile and context exist, and it tags the image with the chart's appVersion under the
    repository the README's `helm install` sets."""
    words = command.argv[2:]
    dockerfile, tag, context = words[words.index("-f") + 1], words[words.index("-t") + 1], words[-1]
    repo_path(dockerfile, "Dockerfile")
    assert repo_path(context, "build context") == ROOT / "."
    repository, _, version = tag.rpartition(":")
    assert re.fullmatch(r"[a-z0-9]+([._/-][a-z0-9]+)*", repository), f"{repository!r} is not a valid image name"
    chart = yaml.safe_load((ROOT / "charts" / "switchyard" / "Chart.yaml").read_text())
    assert version == chart["appVersion"], (tag, chart["appVersion"])
    (install,) = [c for c in COMMANDS if c.argv[:2] == ["helm", "install"]]
    assert f"image.repository={repository}" in install.text, f"`{install.text}` does not use {repository}"


def helm_install(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`helm template` with the same release, chart, namespace and values, with the real Helm: the
    values pass the chart's schema and each set value reaches the rendered objects."""
    from helpers.chart_helpers import run_helm

    repo_path(command.argv[3], "chart")
    monkeypatch.chdir(ROOT)  # the chart's path is the repository's
    rendered = run_helm("template", *command.argv[2:]).stdout
    for i, word in enumerate(command.argv):
        if word == "--set":
            value = command.argv[i + 1].partition("=")[2]
            assert value in rendered, f"--set {command.argv[i + 1]} is not in the rendered chart"


def helm_uninstall(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Needs a cluster: it names the release and namespace the README's `helm install` makes."""
    (install,) = [c for c in COMMANDS if c.argv[:2] == ["helm", "install"]]

    def namespace(argv: list[str]) -> str:
        return argv[argv.index("--namespace") + 1]

    assert command.argv[2] == install.argv[2], "not the installed release"
    assert namespace(command.argv) == namespace(install.argv), "not the installed release's namespace"


def kubectl_apply(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every object in the file passes validation offline: DecodeServices against the CRD's schema as
    the API server admits them, everything else against the Kubernetes schemas, strictly."""
    import kubernetes_validate
    from helpers.kube import crschema
    from switchyard.operator import crd

    words = command.argv[2:]
    assert words[0] == "-f" and len(words) == 2, command.text
    docs = yaml_docs(repo_path(words[1], "manifest"))
    assert docs, f"{words[1]} holds no objects"
    for doc in docs:
        if doc["kind"] == "DecodeService":
            _, errors = crschema.admit(crd.openapi_schema(), doc, strict=True)
            assert errors == [], errors
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def kubectl_names(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Needs a cluster: the resource types, objects, namespaces and ports it names are those the
    repository defines (the CRD's names, the install bundle, the example DecodeServices and what the
    operator renders for them)."""
    words, namespace = [], ""
    argv = command.argv[1:]
    while argv:
        word = argv.pop(0)
        if word in ("-n", "--namespace"):
            namespace = argv.pop(0)
        elif word == "-f":
            repo_path(argv.pop(0), "manifest")  # its objects are checked where the README applies it
        elif word.startswith("-"):
            assert word in ("--all", "--all-namespaces"), f"no check for kubectl flag {word}"
        else:
            words.append(word)
    verb, *rest = words
    if verb == "rollout":
        assert rest[0] == "status", command.text
        kind, _, name = rest[1].partition("/")
        bundle = yaml_docs(ROOT / "manifests" / "install.yaml")
        assert any(d["kind"].lower() == kind and d["metadata"]["name"] == name
                   and d["metadata"].get("namespace") == namespace for d in bundle), f"no {rest[1]} in {namespace}"
    elif verb == "delete" and not rest:
        assert "-f" in command.argv, command.text
    elif verb in ("get", "describe", "delete") and rest[0] in ("crd", "crds", "customresourcedefinition"):
        names = {yaml.safe_load(p.read_text())["metadata"]["name"] for p in CRDS.glob("*.yaml")}
        assert set(rest[1:]) <= names and rest[1:], f"{rest[1:]} are not the chart's CRDs {sorted(names)}"
    elif verb in ("get", "describe", "delete"):
        assert rest[0] in decode_service_names(), f"{rest[0]!r} is not a name of the DecodeService resource"
        for name in rest[1:]:
            example_decode_service(name)
    elif verb == "port-forward":
        kind, _, name = rest[0].partition("/")
        assert kind in ("service", "svc") and rest[1:], command.text
        services = [o for o in rendered_objects(example_decode_service(name)) if o["kind"] == "Service"]
        for mapping in rest[1:]:
            remote = int(mapping.rpartition(":")[2])
            assert any(o["metadata"]["name"] == name and remote in [p["port"] for p in o["spec"]["ports"]]
                       for o in services), f"the operator renders no Service {name} with port {remote}"
    else:
        raise AssertionError(f"no check for `kubectl {verb}`")


def decode_service_names() -> set[str]:
    from switchyard.operator import crd

    names = crd.load_crd()["spec"]["names"]
    return {names["plural"], names["singular"], names["kind"].lower(), *names.get("shortNames", [])}


def example_decode_service(name: str) -> dict[str, Any]:
    for path in EXAMPLES.glob("*.yaml"):
        for doc in yaml_docs(path):
            if doc["kind"] == "DecodeService" and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no example DecodeService named {name!r} in manifests/examples")


def rendered_objects(body: dict[str, Any]) -> list[dict[str, Any]]:
    """What the operator creates for the DecodeService on the example nodes."""
    from switchyard.operator import inventory, planner, render
    from switchyard.operator import spec as specmod

    body = {**body, "metadata": {"namespace": "default", **body["metadata"], "uid": "uid"}}
    spec = specmod.normalized(body["spec"])
    nodes = yaml.safe_load(EXAMPLE_NODES.read_text())["items"]
    plan = planner.plan(specmod.model_spec(spec), inventory.build(nodes), specmod.request(spec))
    return render.render(body, spec, plan, specmod.model_source(spec))


def switchyard_plan(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run as written, from the repository's top folder (a reader's checkout): the inventory it names is
    shipped, and each of its Nodes is a valid Kubernetes Node."""
    import kubernetes_validate
    from switchyard.cli.main import main

    monkeypatch.chdir(ROOT)
    nodes = repo_path(command.argv[command.argv.index("--nodes") + 1], "--nodes file")
    for doc in yaml_docs(nodes):
        for node in doc["items"]:
            kubernetes_validate.validate(node, K8S_VERSION, strict=True)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(command.argv[1:]) == 0
    out = out.getvalue()
    assert "Planned" in out and "TP" in out, out


def benchmark_parsed(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU benchmark: the script exists and its own parser takes the words (a GPU run is what it is for;
    tests/benchmarks runs it on CPU)."""
    from helpers import scripts

    script = repo_path(command.argv[1], "benchmark script")
    module = scripts.load(script.stem)
    try:
        module.parse_args(command.argv[2:])
    except SystemExit as err:
        pytest.fail(f"`{command.text}` does not parse (exit {err.code})")


# ---- the table ---------------------------------------------------------------------------------------

SERVED = "run against a served tiny model (one server for all)"
# (pattern the whole command matches, how it is exercised, the check; None: in the served test)
CHECKS: list[tuple[str, str, Callable[..., None] | None]] = [
    (r"make (demo|test)", "make -n; its switchyard commands parsed", make_dry_run),
    (r"python -m switchyard\.kernels\.build", "needs nvcc: the module's parser (--help)", module_help),
    (r"switchyard make-checkpoint .+", "run, stopped after it says the size and where", checkpoint_size_first),
    (r"switchyard serve --tiny .+", "run on a free port until it listens, then Ctrl-C", serve_until_listening),
    (r"switchyard serve (?!--tiny).+", "GPU/size/ports: parsed, start-up checks run", parsed_cli),
    (r"switchyard (generate|trace)( .+)?", SERVED, None),
    (r"grpcurl .+", SERVED, None),
    (r"curl .+", SERVED, None),
    (r"guidellm run .+", SERVED, None),
    (r"python benchmarks/\S+\.py .+", "GPU: the script's own parser takes the words", benchmark_parsed),
    (ECHO, "run in a scratch folder; the layout it writes is valid", written_layout),
    (r"docker build .+", "Dockerfile and context exist; tag as the chart expects", docker_build),
    (r"helm install .+", "helm template with the same arguments", helm_install),
    (r"helm uninstall .+", "the installed release and namespace", helm_uninstall),
    (r"kubectl apply -f \S+", "each object validated against its schema", kubectl_apply),
    (r"kubectl (-n \S+ )?(rollout status|get|describe|delete|port-forward) .+",
     "needs a cluster: the names it uses exist", kubectl_names),
    (r"switchyard plan .+", "run as written, on the shipped example nodes", switchyard_plan),
]


def row(command: Command) -> tuple[str, str, Callable[..., None] | None]:
    rows = [r for r in CHECKS if re.fullmatch(r[0], command.text)]
    assert len(rows) == 1, f"README command `{command.line}` matches {len(rows)} rows of CHECKS, not 1"
    return rows[0]


def unchecked(commands: list[Command]) -> list[str]:
    """The commands that no row, or more than one, of CHECKS matches."""
    return [c.line for c in commands if sum(bool(re.fullmatch(r[0], c.text)) for r in CHECKS) != 1]


def test_every_readme_command_has_a_check() -> None:
    assert len(COMMANDS) >= 20, "the README's shell blocks were not found"
    missing = unchecked(COMMANDS)
    assert not missing, "README commands with no single row in CHECKS:\n" + "\n".join(missing)


def test_a_command_the_table_does_not_know_is_caught() -> None:
    text = "```sh\nmake demo\nmake clean\nkubectl edit decodeservice x\n```\n"
    assert unchecked(readme_commands(text)) == ["make clean", "kubectl edit decodeservice x"]


def test_the_command_reader_follows_shell_rules() -> None:
    text = "```sh\nA=1 prog --x 'a b' \\\n    --y 2 &   # note\n# only a comment\nfirst  # or: second -v\n```\n" \
           "```console\n$ other run\noutput line\n```\n```python\nnot_shell()\n```\n"
    commands = readme_commands(text)
    assert [(c.block, c.env, c.argv) for c in commands] == [
        (0, {"A": "1"}, ["prog", "--x", "a b", "--y", "2"]), (0, {}, ["first"]), (0, {}, ["second", "-v"]),
        (1, {}, ["other", "run"])]


STANDALONE = [c for c in COMMANDS if c.argv and row(c)[2] is not None]


@pytest.mark.parametrize("command", STANDALONE,
                         ids=[" ".join([*(f"{k}={v}" for k, v in c.env.items()), c.text])[:72] for c in STANDALONE])
def test_readme_command(command: Command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    check = row(command)[2]
    assert check is not None
    check(command, tmp_path, monkeypatch)


# ---- the commands run against a server ------------------------------------------------------------------


def grpcurl(argv: list[str], target: str) -> str:
    """The grpcurl command, run: with grpcurl where it is installed, else as grpcurl does it (the
    method's types from server reflection, the -d JSON parsed into the request, JSON replies)."""
    argv = [target if w == "localhost:8001" else w for w in argv]
    if shutil.which("grpcurl"):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout
    import grpc
    from google.protobuf import json_format, message_factory
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    words, data = argv[1:], "{}"
    while words[0].startswith("-"):
        flag = words.pop(0)
        if flag == "-d":
            data = words.pop(0)
        else:
            assert flag == "-plaintext", f"no emulation of grpcurl {flag}"
    address, method_path = words
    service_name, _, method_name = method_path.partition("/")
    with grpc.insecure_channel(address) as channel:
        method = DescriptorPool(ProtoReflectionDescriptorDatabase(channel)).FindServiceByName(
            service_name).methods_by_name[method_name]
        request = json_format.Parse(data, message_factory.GetMessageClass(method.input_type)())
        reply = message_factory.GetMessageClass(method.output_type)
        call = (channel.unary_stream if method.server_streaming else channel.unary_unary)(
            f"/{method_path}", request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=reply.FromString)
        replies = list(call(request, timeout=60)) if method.server_streaming else [call(request, timeout=60)]
    return "\n".join(json_format.MessageToJson(r) for r in replies)


def curl(argv: list[str]) -> str:
    """The curl command, run: with curl where it is installed, else as curl does it for the flags the
    README uses (-N, -H, -d: a POST of that body)."""
    if shutil.which("curl"):
        done = subprocess.run([*argv[:1], "--silent", "--show-error", *argv[1:]], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout
    from helpers.http_raw import call

    words, headers, data = argv[1:], {}, None
    url = next(w for w in words if not w.startswith("-") and "localhost" not in w and ":" in w and "/" in w)
    while words:
        word = words.pop(0)
        if word == "-H":
            name, _, value = words.pop(0).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            data = words.pop(0).encode()
        else:
            assert word == "-N" or word == url, f"no emulation of curl {word}"
    status, _, body = call("http://" + url, "POST" if data is not None else "GET", raw=data, headers=headers)
    assert status == 200, body[:2000]
    return body.decode()


def check_http_answer(url: str, data: str | None, out: str) -> None:
    """What the README's curl command printed is what its route answers."""
    from prometheus_client.parser import text_string_to_metric_families

    route = url.partition("/")[2]
    if route == "v1/models":
        assert [m["id"] for m in json.loads(out)["data"]] == ["tiny"], out
    elif route == "metrics":
        names = {family.name for family in text_string_to_metric_families(out)}
        assert {"switchyard_requests", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= names, names
    elif json.loads(data or "{}").get("stream"):
        events = [line for line in out.splitlines() if line]
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events), out[-2000:]
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks and {c["object"] for c in chunks} == {"chat.completion.chunk"}, out[-2000:]
    else:
        answer = json.loads(out)
        assert answer["object"] == "text_completion" and answer["choices"][0]["text"], out
        assert answer["usage"]["completion_tokens"] == json.loads(data)["max_tokens"], out


def guidellm_run(argv: list[str], cwd: Path) -> None:
    """guidellm as written (from beside this Python); its report counts every request it was told to send
    as answered, each with the output length asked for."""
    binary = Path(sys.executable).with_name("guidellm")
    assert binary.exists(), "guidellm is not installed beside this Python: pip install -e '.[dev]'"
    done = subprocess.run([str(binary), *argv[1:], "--disable-console-interactive"], cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    options = {word.partition("=")[0]: word.partition("=")[2]
               for flag, value in itertools.pairwise(argv) if flag.startswith("--")
               for word in value.split(",")}
    (bench,) = json.loads((cwd / options["path"]).read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    assert totals["successful"] == totals["total"] == int(options["count"]), totals
    outputs = {r["output_tokens"] for r in bench["requests"]["successful"]}
    assert outputs == {int(options["output_tokens"])}, outputs


def test_readme_client_commands_run_against_a_served_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture) -> None:
    from switchyard.cli.main import main
    from switchyard.service.telemetry.tracing import Telemetry

    commands = [c for c in COMMANDS if row(c)[1] == SERVED]
    programs = {" ".join(c.argv[:2]) for c in commands}
    assert {"switchyard generate", "switchyard trace", "guidellm run"} <= programs, programs
    routes = {w.partition("/")[2] for c in commands if c.argv[0] == "curl" for w in c.argv if w.startswith("localhost")}
    assert routes >= {"v1/models", "v1/completions", "v1/chat/completions", "metrics"}, routes
    monkeypatch.chdir(tmp_path)  # where a stray file would land
    trace_file = tmp_path / "traces.jsonl"
    telemetry = Telemetry.from_env(str(trace_file))
    request_ids: list[str] = []
    with serving(telemetry=telemetry, http=True) as served:
        http_address = served.http_url.removeprefix("http://")
        # The README's model names (a checkpoint folder's, a DecodeService's) and its model folder.
        names = {'"llama3-8b"': '"tiny"', '"llama-3-8b"': '"tiny"', "model=llama3-8b": "model=tiny",
                 "model=/models/llama3-8b": f"model={tiny_dir()}", "localhost:8000": http_address}

        def local(word: str) -> str:
            for old, new in names.items():
                word = word.replace(old, new)
            return word

        for command in commands:
            values = {"localhost:8001": served.target, "/tmp/traces.jsonl": str(trace_file),
                      "trace.png": str(tmp_path / "trace.png"), "ID": request_ids[-1] if request_ids else "ID"}
            argv = [values.get(w, local(w)) for w in command.argv]
            if argv[0] == "grpcurl":
                out = grpcurl(argv, served.target)
                assert out.strip() and "{" in out, out
                continue
            if argv[0] == "curl":
                url = next(w for w in argv[1:] if w.startswith(http_address))
                data = argv[argv.index("-d") + 1] if "-d" in argv else None
                check_http_answer(url, data, curl(argv))
                continue
            if argv[0] == "guidellm":
                guidellm_run(argv, tmp_path)
                continue
            if argv[1] == "trace":
                assert request_ids, f"`{command.line}` comes before any generate"
                served.wait_recorded(request_ids)
                served.recorder.flush()
            assert main(argv[1:]) == 0, f"`{command.line}`: {capsys.readouterr().err[-2000:]}"
            out = capsys.readouterr().out
            if argv[1] == "generate":
                request_ids.append(re.search(r"request (\S+): \d+ tokens", out).group(1))
            else:
                assert request_ids[-1] in out, out[-2000:]
                if "--png" in argv:
                    assert Path(argv[argv.index("--png") + 1]).stat().st_size > 0
                else:  # nothing written that was not asked for
                    assert not list(tmp_path.glob("*.png")), list(tmp_path.glob("*.png"))
    if telemetry is not None:
        telemetry.shutdown()
