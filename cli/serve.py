"""``switchyard serve``: run the decode service for one model: gRPC (Decode, KServe v2) on ``--port``,
the OpenAI-compatible HTTP API with ``/health`` and ``/metrics`` on ``--http-port``.

Configuration comes from flags, each with an environment variable (``SWITCHYARD_<FLAG>``); a layout
file (``--layout``, written by the operator) overrides the layout fields it sets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from switchyard.cli.usage import (
    UsageError,
    existing_file,
    existing_folder,
    positive,
    writable_file,
    writable_folder,
)

LAYOUT_FLAGS = {  # ServingLayout field -> flag dest
    "tp": "tp",
    "strategy": "strategy",
    "batch_slots": "batch_slots",
    "max_seq_len": "max_seq_len",
    "model_name": "model_name",
    "model_path": "model_path",
    "kv_tokens": "kv_tokens",
    "kv_memory_fraction": "kv_memory_fraction",
    "step_tokens": "step_tokens",
    "quantization": "quantization",
    "kv_cache_dtype": "kv_cache_dtype",
}


def _env(name: str, default: Any, kind: type = str) -> Any:
    raw = os.environ.get(f"SWITCHYARD_{name}")
    return default if raw is None or raw == "" else kind(raw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layout",
        default=_env("LAYOUT", None),
        help="layout JSON file (the operator's); its fields override the flags [SWITCHYARD_LAYOUT]",
    )
    parser.add_argument(
        "--model-path",
        default=_env("MODEL_PATH", None),
        help="checkpoint folder: config.json, *.safetensors, tokenizer.json [SWITCHYARD_MODEL_PATH]",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="serve a random-weight tiny model made on the spot (demo and tests)",
    )
    parser.add_argument(
        "--model-name",
        default=_env("MODEL_NAME", ""),
        help="name clients use (default: the checkpoint folder's name) [SWITCHYARD_MODEL_NAME]",
    )
    parser.add_argument("--host", default=_env("HOST", "[::]"), help="listen address [SWITCHYARD_HOST]")
    parser.add_argument(
        "--port", type=int, default=_env("PORT", 8001, int), help="gRPC port (Decode, KServe v2) [SWITCHYARD_PORT]"
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=_env("HTTP_PORT", 8000, int),
        help="HTTP port: the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models), "
        "/health and Prometheus /metrics (default 8000) [SWITCHYARD_HTTP_PORT]",
    )
    parser.add_argument(
        "--tp", type=int, default=_env("TP", 1, int), help="tensor-parallel size [SWITCHYARD_TP]"
    )
    parser.add_argument(
        "--strategy",
        default=_env("STRATEGY", "auto"),
        help="all-reduce strategy: auto, xla, oneshot, twoshot [SWITCHYARD_STRATEGY]",
    )
    parser.add_argument(
        "--batch-slots",
        type=int,
        default=_env("BATCH_SLOTS", 8, int),
        help="requests decoded together [SWITCHYARD_BATCH_SLOTS]",
    )
    parser.add_argument(
        "--max-seq-len",
        type=int,
        default=_env("MAX_SEQ_LEN", 2048, int),
        help="prompt + output tokens per request (KV budget) [SWITCHYARD_MAX_SEQ_LEN]",
    )
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=_env("KV_TOKENS", None, int),
        help="tokens the paged KV cache holds, a multiple of 64 and at least --max-seq-len "
        "(default 0: size it at start-up from the memory left after the weights) [SWITCHYARD_KV_TOKENS]",
    )
    parser.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=_env("KV_MEMORY_FRACTION", None, float),
        help="share of the memory left after the weights the KV cache takes when --kv-tokens is 0, "
        "in (0, 0.95] (default 0.9) [SWITCHYARD_KV_MEMORY_FRACTION]",
    )
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=_env("STEP_TOKENS", None, int),
        help="prompt tokens one step carries next to a token for each decoding sequence, a multiple "
        "of 16 (default 256) [SWITCHYARD_STEP_TOKENS]",
    )
    parser.add_argument(
        "--dtype", default=_env("DTYPE", None), help="weights dtype (default: the checkpoint's)"
    )
    parser.add_argument(
        "--quantization",
        default=_env("QUANTIZATION", None),
        help="layer matrices: auto (as the checkpoint holds them: an FP8 checkpoint in FP8), fp8 (a 16-bit "
        "checkpoint quantized at load, a scale per output channel), none (an FP8 checkpoint dequantized) "
        "(default auto) [SWITCHYARD_QUANTIZATION]",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=_env("KV_CACHE_DTYPE", None),
        help="KV cache: auto (the model's dtype) or fp8 (e4m3 with a scale per position and KV head: about "
        "twice the tokens in the same memory) (default auto) [SWITCHYARD_KV_CACHE_DTYPE]",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=_env("MAX_QUEUE", 64, int),
        help="requests waiting for a slot before RESOURCE_EXHAUSTED [SWITCHYARD_MAX_QUEUE]",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=_env("DEFAULT_MAX_TOKENS", 256, int),
        help="max_tokens of a request that sets none [SWITCHYARD_DEFAULT_MAX_TOKENS]",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=_env("MAX_REQUEST_BYTES", 1 << 20, int),
        help="larger requests get INVALID_ARGUMENT [SWITCHYARD_MAX_REQUEST_BYTES]",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=_env("GRACE_PERIOD", 30.0, float),
        help="seconds in-flight requests get to finish after SIGTERM [SWITCHYARD_GRACE_PERIOD]",
    )
    parser.add_argument(
        "--trace-file",
        default=_env("TRACE_FILE", None),
        help="also write request spans as OTLP-JSON lines here [SWITCHYARD_TRACE_FILE]",
    )
    parser.add_argument(
        "--keep-traces",
        type=int,
        default=_env("KEEP_TRACES", 256, int),
        help="finished requests kept for GetTraces / switchyard trace --target",
    )
    parser.add_argument(
        "--no-warmup", action="store_true", help="compile steps on first use instead of at start"
    )
    parser.add_argument(
        "--compile-cache",
        default=_env("COMPILE_CACHE", None),
        help="folder that keeps compiled step programs between starts (created if missing; pods of one "
        "node may share it); default: none, every start compiles [SWITCHYARD_COMPILE_CACHE]",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=_env("SWITCH_INTERVAL", None, float),
        help="CPython GIL switch interval in seconds (default: CPython's, 0.005); benchmarks/serve.py "
        "measures the effect [SWITCHYARD_SWITCH_INTERVAL]",
    )
    parser.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR [SWITCHYARD_LOG_LEVEL]")


def resolve_layout(args: argparse.Namespace) -> Any:
    """The ServingLayout from flags, with the layout file's fields on top (UsageError if unusable)."""
    from switchyard.service.modelspec import STRATEGIES, ModelSpecError, ServingLayout

    for flag in ("tp", "batch_slots", "max_seq_len", "max_queue", "default_max_tokens", "max_request_bytes"):
        positive(getattr(args, flag), "--" + flag.replace("_", "-"))
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if not 0 <= args.http_port <= 65535:
        raise UsageError(f"--http-port must be in [0, 65535], got {args.http_port}")
    if args.http_port == args.port and args.port != 0:
        raise UsageError(f"--http-port and --port must differ, both are {args.port}")
    if args.grace_period < 0:
        raise UsageError(f"--grace-period must be zero or more seconds, got {args.grace_period}")
    if args.strategy not in STRATEGIES:
        raise UsageError(f"--strategy {args.strategy!r} is not one of {', '.join(STRATEGIES)}")
    # The KV and step flags default to the layout's own defaults (one place: ServingLayout).
    kv_and_step = {f: getattr(args, f) for f in ("kv_tokens", "kv_memory_fraction", "step_tokens", "quantization",
                                                 "kv_cache_dtype")}
    try:
        layout = ServingLayout(
            tp=args.tp,
            strategy=args.strategy,
            batch_slots=args.batch_slots,
            max_seq_len=args.max_seq_len,
            model_name=args.model_name or "",
            model_path=args.model_path or "",
            **{k: v for k, v in kv_and_step.items() if v is not None},
        )
    except ModelSpecError as err:
        raise UsageError(_in_flag_words(str(err))) from None
    if args.layout:
        text = existing_file(args.layout, "layout file").read_text()
        try:
            from_file = ServingLayout.from_json(text)  # validates, rejects unknown fields
        except (ModelSpecError, TypeError) as err:
            raise UsageError(f"layout file {args.layout!r}: {err}") from None
        given = json.loads(text)
        try:
            layout = dataclasses.replace(layout, **{k: getattr(from_file, k) for k in given})
        except ModelSpecError as err:  # a file field against a flag left to it (kv_tokens vs max_seq_len)
            raise UsageError(f"layout file {args.layout!r} with the flags: {_in_flag_words(str(err))}") from None
    if layout.pp > 1:
        # One layout file serves a whole pipeline group; each pod learns its stage from its environment
        # (the operator maps the StatefulSet pod index into it).
        variable = str(layout.extra.get("pipeline_stage_env") or "SWITCHYARD_PIPELINE_STAGE")
        if variable in os.environ:
            try:
                layout = dataclasses.replace(layout, pipeline_stage=int(os.environ[variable]))
            except (ValueError, ModelSpecError) as err:
                raise UsageError(f"{variable}={os.environ[variable]!r}: {err}") from None
    return layout


def _in_flag_words(message: str) -> str:
    """A ServingLayout error about ``layout.<field>`` as one about the flag that sets the field."""
    for field, dest in LAYOUT_FLAGS.items():
        message = message.replace(f"layout.{field}", "--" + dest.replace("_", "-"))
    return message


def check_port_free(host: str, port: int, flag: str = "") -> None:
    """UsageError unless ``host:port`` can be listened on now (a moment later someone else may take
    it; the server still reports that as it always has). ``flag`` names the option that chose it."""
    import socket

    bind_host = host.strip("[]")
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As the gRPC server binds: a port whose last connections linger in TIME_WAIT is free to it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((bind_host, port))
        except OSError as err:
            where = f"{host}:{port}" + (f" ({flag})" if flag else "")
            raise UsageError(f"cannot listen on {where}: {err.strerror}") from None


def check_model(layout: Any, model_path: str, args: argparse.Namespace, model_name: str = "") -> tuple[Any, Any]:
    """Everything about the model that can be known before the port opens and the compile starts:
    the folder and its files, the context and tensor-parallel size against the model, the trace file
    (the devices are the engine process's to count). Returns (ModelSpec, Tokenizer); raises UsageError."""
    from switchyard.service.engine.fp8_checkpoint import check_checkpoint
    from switchyard.service.engine.model import ShardShape
    from switchyard.service.engine.tensor_source import CheckpointError
    from switchyard.service.engine.tokenizer import Tokenizer
    from switchyard.service.modelspec import ModelSpec, ModelSpecError, check_context

    folder = existing_folder(model_path, "model folder")
    for required in ("config.json", "tokenizer.json"):
        if not (folder / required).is_file():
            raise UsageError(f"model folder {str(folder)!r} has no {required}")
    if not any(folder.glob("*.safetensors")):
        raise UsageError(f"model folder {str(folder)!r} has no *.safetensors weights")
    try:
        spec = ModelSpec.from_file(folder)
    except ModelSpecError as err:
        raise UsageError(f"model folder {str(folder)!r}: {err}") from None
    if not 2 <= layout.max_seq_len <= spec.max_position_embeddings:
        raise UsageError(f"--max-seq-len {layout.max_seq_len} is outside [2, {spec.max_position_embeddings}], "
                         f"the context of {model_name or spec.name}")
    try:
        check_context(spec, layout.max_seq_len)
    except ModelSpecError as err:
        raise UsageError(f"--max-seq-len {layout.max_seq_len}: {err}") from None
    try:
        ShardShape(spec, layout.tp)
    except ValueError as err:
        raise UsageError(f"--tp {layout.tp}: {err}") from None
    try:  # FP8 formats, scales and shards, read before anything loads
        check_checkpoint(folder, spec, layout.tp, layout.quantization, layout.pp)
    except (CheckpointError, ValueError) as err:
        raise UsageError(f"model folder {str(folder)!r}: {err}") from None
    if args.trace_file:
        writable_file(args.trace_file, "--trace-file")
    if args.compile_cache:
        writable_folder(args.compile_cache, "--compile-cache")
    try:
        return spec, Tokenizer.from_dir(folder, spec)
    except Exception as err:  # a tokenizer.json the tokenizers library cannot read
        raise UsageError(f"model folder {str(folder)!r}: tokenizer.json does not load: {err}") from None


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What the engine process needs to build the engine (picklable)."""

    model_path: str
    layout: Any  # ServingLayout
    dtype: str | None
    warmup: bool
    compile_cache: str | None = None


# How often the engine process logs its compiling's progress (and once at the end).
PROGRESS_EVERY_S = 5.0


class CompileProgress:
    """``on_program(done, total)`` for a warm-up: tells the server, and logs a line every
    :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, log: logging.Logger) -> None:
        import time

        self._clock = time.monotonic
        self._log = log
        self._start = self._last = self._clock()

    def __call__(self, done: int, total: int) -> None:
        from switchyard.service.api.engine_process import report_startup

        report_startup(COMPILING, done, total)
        now = self._clock()
        if now - self._last >= PROGRESS_EVERY_S and done < total:
            self._last = now
            self._log.info("%s: %d of %d ready after %.0f s", COMPILING, done, total, now - self._start)


COMPILING = "compiling step programs"
LOADING = "loading weights"


def warm_up(engine: Any, options: EngineOptions, store: Any = None) -> Any:
    """In the engine process: make every step program of ``engine`` ready (unless the options say
    not to), from ``store`` where it holds them, and freeze the warm heap. Returns the WarmUp."""
    from switchyard.service.engine.compile_cache import WarmUp
    from switchyard.service.engine.heap import freeze_warm_heap

    if not options.warmup:
        return WarmUp(0.0, 0)
    log = logging.getLogger("switchyard.serve")
    warmup = engine.warmup(store, CompileProgress(log))
    log.info("warm-up: %s", warmup.describe())
    log.info("heap: %d objects frozen after warm-up (a full collection took %.0f ms)", *freeze_warm_heap())
    return warmup


def open_compile_cache(options: EngineOptions) -> Any:
    """In an engine's process, before anything compiles: the compile cache the options name (XLA's
    layer on from here), or None."""
    if not options.compile_cache:
        return None
    from switchyard.kernels.native import library_path
    from switchyard.service.engine.compile_cache import open_cache

    return open_cache(options.compile_cache, library_path())


def load_engine(options: EngineOptions) -> Any:
    """The engine of the checkpoint, as the layout says (a pipeline stage's share with ``pp`` > 1); the
    loading's progress goes to the log (``service.progress``)."""
    from switchyard.service.api.engine_process import report_startup
    from switchyard.service.engine.engine import Engine, EngineConfig

    report_startup(LOADING)
    config = EngineConfig.from_layout(options.layout, dtype=options.dtype)
    return Engine.from_checkpoint(options.model_path, options.layout, config, progress=True)


def build_engine(options: EngineOptions) -> tuple[Any, Any]:
    """The engine process's builder: the engine from the checkpoint, every step program ready (from
    the compile cache where it has them) and the warm heap frozen. Returns (engine, WarmUp)."""
    cache = open_compile_cache(options)
    engine = load_engine(options)
    return engine, warm_up(engine, options, None if cache is None else cache.programs)


def choose_xla_runtime(options: EngineOptions) -> None:
    """The engine process, before it looks at its devices: XLA's allocator and its share of each GPU
    (``service.engine.xla_runtime``)."""
    from switchyard.service.engine.xla_runtime import apply_process_defaults

    apply_process_defaults()


def join_pipeline_group(options: EngineOptions) -> None:
    """Stage 0's engine process, before it looks at its devices: join the pipeline group (the
    distributed runtime must start before any device is used); GroupFormationError if it cannot."""
    from switchyard.service.engine.pipeline_group import join

    layout = options.layout
    logging.getLogger("switchyard.serve").info("joining pipeline group of %d stages at %s as stage 0", layout.pp,
                                               layout.coordinator)
    join(layout)


def build_pipeline_leader(options: EngineOptions) -> tuple[Any, Any]:
    """Stage 0's engine process's builder: its stage of the pipeline, sending every plan to the other
    stages, every program compiled on every stage (XLA's layer of the compile cache serving each) and
    the warm heap frozen."""
    from switchyard.service.engine.pipeline_group import CommandChannel, LeaderEngine

    open_compile_cache(options)
    engine = LeaderEngine(load_engine(options), CommandChannel.open(options.layout))
    return engine, warm_up(engine, options)


def release_pipeline_group(engine: Any) -> None:
    """Stage 0's engine process, after a clean stop: let the other stages go (they exit 0)."""
    engine.stop()


def start_engine_process(layout: Any, model_path: str, model_name: str, args: argparse.Namespace) -> Any:
    """The engine in a process of its own (``service.api.engine_process``), once it has counted its
    devices (as stage 0 of a pipeline group, once it has joined the group); UsageError (the process
    stopped) when they cannot hold the tensor-parallel group, GroupFormationError when the group did
    not form."""
    from switchyard.service.api.engine_process import EngineProcess, EngineProcessLost, EngineStartError

    options = EngineOptions(model_path, layout, args.dtype, not args.no_warmup, args.compile_cache)
    group = ({"prepare": join_pipeline_group, "release": release_pipeline_group} if layout.pp > 1
             else {"prepare": choose_xla_runtime})
    process = EngineProcess(build_pipeline_leader if layout.pp > 1 else build_engine, options, **group,
                            scheduler_options={"max_queue": args.max_queue, "model_name": model_name},
                            log_level=args.log_level)
    try:
        devices = process.wait_devices()
    except (EngineStartError, EngineProcessLost) as err:
        process.close()
        raise UsageError(f"the engine process could not start: {err}") from None
    if layout.tp > devices.count:
        process.close()
        cpu = (f"; on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count={layout.tp} in the environment "
               f"splits it into {layout.tp} devices") if devices.platform == "cpu" else ""
        raise UsageError(f"--tp {layout.tp} needs {layout.tp} devices; the engine process sees {devices.count} "
                         f"({devices.platform}){cpu}")
    return process


def run(args: argparse.Namespace) -> int:
    import asyncio
    import tempfile

    from switchyard.service.logs import quiet_known_noise

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_known_noise()
    log = logging.getLogger("switchyard.serve")
    layout = resolve_layout(args)
    model_path = layout.model_path
    scratch = None
    if args.tiny and not model_path:
        from switchyard.service.engine.checkpoint import write_checkpoint
        from switchyard.service.modelspec import preset

        scratch = tempfile.TemporaryDirectory(prefix="switchyard-tiny-")
        model_path = str(write_checkpoint(preset("tiny"), scratch.name, progress=False))
    if not model_path:
        raise UsageError("no model: give --model-path (or SWITCHYARD_MODEL_PATH, or model_path in the layout) "
                         "or --tiny")
    model_name = layout.model_name or Path(model_path).resolve().name
    if args.tiny and not layout.model_name:
        model_name = "tiny"
    _, tokenizer = check_model(layout, model_path, args, model_name)
    # Before the engine starts (and, in a pipeline group, before joining it: a stage that joined and
    # then failed would hold the others in the distributed runtime until its timeouts ran out), and in
    # one line: the gRPC server failing to bind a taken port adds its core's own error to ours.
    check_port_free(args.host, args.port)
    if args.http_port:
        check_port_free(args.host, args.http_port, "--http-port")
    if layout.pp > 1 and layout.pipeline_stage > 0:
        return run_pipeline_follower(layout, model_path, args, log)
    # The engine and its scheduler in a process of their own, so that the server's work never holds
    # up a step (service/api/engine_process.py); as stage 0 of a pipeline group it joins the group there.
    from switchyard.service.errors import GroupFormationError

    try:
        engine_process = start_engine_process(layout, model_path, model_name, args)
    except GroupFormationError as err:  # nothing joined yet: one line, and a plain exit
        log.error("%s", err)
        if scratch is not None:
            scratch.cleanup()
        return 1

    from switchyard.service.api.http.chat_template import ChatTemplate
    from switchyard.service.api.server import STOPPED_WHILE_LOADING, DecodeApp, ServeOptions, serve, tune_interpreter
    from switchyard.service.api.wire import Limits
    from switchyard.service.telemetry.traces import KV_CACHE, WEIGHTS
    from switchyard.service.telemetry.tracing import RequestRecorder, Telemetry

    chat_template = ChatTemplate.from_dir(model_path)
    if not chat_template.available:
        log.warning("no chat on /v1/chat/completions: %s", chat_template.problem)
    recorder = RequestRecorder(Telemetry.from_env(args.trace_file), keep=args.keep_traces)
    app = DecodeApp(
        model_name=model_name,
        limits=Limits(default_max_tokens=args.default_max_tokens, max_request_bytes=args.max_request_bytes),
        recorder=recorder,
        info={
            "tensor_parallel": layout.tp,
            "allreduce_strategy": layout.strategy,
            "max_queue": args.max_queue,
        },
        chat_template=chat_template,
    )

    app.startup = lambda: engine_process.startup

    def load() -> tuple[Any, Any]:
        from switchyard.service.engine.heap import freeze_warm_heap

        log.info(
            "loading %s from %s (tp=%d, strategy=%s, %d sequences at once, context %d)",
            model_name,
            model_path,
            layout.tp,
            layout.strategy,
            layout.batch_slots,
            layout.max_seq_len,
        )
        facts = engine_process.wait_ready()  # the engine loads in its own process
        app.info["compile_cache"] = facts.compile_cache
        app.info["weights"], app.info["kv_cache"] = facts.weights, facts.kv_cache
        recorder.served = {WEIGHTS: facts.weights, KV_CACHE: facts.kv_cache}
        log.info("serving weights: %s; KV cache: %s, %d tokens", facts.weights, facts.kv_cache, facts.kv_tokens)
        # This process delivers every token: a full collection scanning its libraries' objects
        # (transformers, gRPC) would hold every stream for as long as it takes.
        log.info("heap: %d objects of the server's process frozen (a full collection took %.0f ms)",
                 *freeze_warm_heap())
        return engine_process, tokenizer

    tune_interpreter(args.switch_interval)
    try:
        code = asyncio.run(serve(app, load, ServeOptions(args.host, args.port, args.grace_period, args.http_port)))
        if code == STOPPED_WHILE_LOADING:
            # The loading thread may be deep in a compile: end now instead of waiting for it.
            if scratch is not None:
                scratch.cleanup()
            logging.shutdown()
            os._exit(code)
        return code
    finally:
        engine_process.close()
        if scratch is not None:
            scratch.cleanup()


def run_pipeline_follower(layout: Any, model_path: str, args: argparse.Namespace, log: logging.Logger) -> int:
    """A later pipeline stage: no Decode API, only gRPC health and HTTP /health (serving while it
    follows stage 0) and /metrics (that one gauge)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from switchyard.service.api.http.health import HealthEndpoint
    from switchyard.service.engine.pipeline_group import CommandChannel, GroupFormationError, exit_now, follow, join

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    if server.add_insecure_port(f"{args.host}:{args.port}") == 0:
        log.error("could not listen on %s:%s", args.host, args.port)
        return 1
    try:  # the pod's probes ask /health of every stage
        http_health = HealthEndpoint(args.host, args.http_port, layout.pipeline_stage)
    except OSError as err:
        log.error("could not listen for HTTP on %s:%s: %s", args.host, args.http_port, err.strerror or err)
        return 1
    server.start()
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        log.info("joining pipeline group of %d stages at %s as stage %d", layout.pp, layout.coordinator,
                 layout.pipeline_stage)
        join(layout)
        options = EngineOptions(model_path, layout, args.dtype, warmup=True, compile_cache=args.compile_cache)
        open_compile_cache(options)
        engine = load_engine(options)
        channel = CommandChannel.open(layout)
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        http_health.serving = True
        log.info("stage %d ready: following stage 0", layout.pipeline_stage)
        follow(engine, channel)
        log.info("stage 0 released the group")
        return 0
    except GroupFormationError as err:  # nothing joined yet: one line, and a plain exit
        log.error("%s", err)
        return 1
    except Exception:
        log.exception("pipeline stage %d failed: stopping so that the group restarts", layout.pipeline_stage)
        exit_now(1)
    finally:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        http_health.serving = False
        http_health.close()
        server.stop(0)
