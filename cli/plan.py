"""``switchyard plan``: the planner's decision and reasons for a model on a set of nodes, offline.

    switchyard plan --model config.json --nodes nodes.yaml --objective latency [--quantization fp8]

``--model`` takes a Hugging Face config.json (or its folder) or a preset name; ``--nodes`` a YAML or
JSON file with Node objects (a ``kubectl get nodes -o yaml`` List, a list, or several documents).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from switchyard.cli.usage import UsageError, existing_file
from switchyard.kernels.selection import STRATEGIES
from switchyard.operator import crd
from switchyard.service.model import quantization as quant


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="config.json, a checkpoint folder, or a preset name")
    parser.add_argument("--quantization", choices=quant.CHOICES, default=crd.spec_default("model.quantization"),
                        help="the layer matrices' format as served, as spec.model.quantization: auto (as the "
                             "checkpoint states), fp8 (quantized at load), none (dequantized) (default: %(default)s)")
    parser.add_argument("--nodes", required=True, type=Path, help="Node objects (YAML or JSON)")
    parser.add_argument("--pods", type=Path, help="Pod objects already using GPUs (optional)")
    parser.add_argument("--objective", choices=("latency", "throughput", "balanced"), default="balanced")
    parser.add_argument("--input-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tpot-ms", type=float, help="SLO: max time per output token")
    parser.add_argument("--max-ttft-ms", type=float, help="SLO: max time to first token")
    parser.add_argument("--target-tokens-per-s", type=float)
    parser.add_argument("--replicas", type=int, help="pin data-parallel replicas")
    parser.add_argument("--tp", type=int, choices=(1, 2, 4, 8))
    parser.add_argument("--pp", type=int)
    parser.add_argument("--strategy", choices=STRATEGIES, default="auto")
    parser.add_argument("--kv-memory-fraction", type=float,
                        help="share of the memory after the weights the KV cache takes (default: the CRD's)")
    parser.add_argument("--step-tokens", type=int, help="prompt tokens per engine step (default: the planner's)")
    parser.add_argument("--calibration", type=Path, help="calibration JSON (default: the packaged one)")
    parser.add_argument("--json", action="store_true", help="print the status the operator would write")


def load_objects(path: Path) -> list[dict[str, Any]]:
    import yaml

    out: list[dict[str, Any]] = []
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except yaml.YAMLError as err:
        raise UsageError(f"{str(path)!r} is not YAML or JSON: {str(err).splitlines()[0]}") from None
    for doc in docs:
        if doc is None:
            continue
        if isinstance(doc, list):
            out += doc
        elif isinstance(doc, dict) and "items" in doc:
            out += doc["items"]
        else:
            out.append(doc)
    return out


def run(args: argparse.Namespace) -> int:
    from switchyard.operator import calibration, inventory, planner, render
    from switchyard.service.modelspec import PRESETS, ModelSpec, ModelSpecError, preset, preset_name

    if preset_name(args.model) is not None:
        model = preset(args.model)
    elif not Path(args.model).exists():
        raise UsageError(f"--model {args.model!r} is neither a file or folder nor a preset "
                         f"({', '.join(PRESETS)})")
    else:
        try:
            model = ModelSpec.from_file(args.model)
        except ModelSpecError as err:
            raise UsageError(str(err)) from None
    model = model.served_as(args.quantization)
    nodes = load_objects(existing_file(args.nodes, "--nodes file"))
    pods = load_objects(existing_file(args.pods, "--pods file")) if args.pods else []
    if args.calibration:
        existing_file(args.calibration, "--calibration file")
    kv_settings = {} if args.kv_memory_fraction is None else {"kv_memory_fraction": args.kv_memory_fraction}
    try:
        request = planner.Request(
            objective=args.objective, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
            concurrency=args.concurrency, max_tpot_ms=args.max_tpot_ms, max_ttft_ms=args.max_ttft_ms,
            target_tokens_per_s=args.target_tokens_per_s, replicas=args.replicas, tp=args.tp, pp=args.pp,
            strategy=args.strategy, step_tokens=args.step_tokens, **kv_settings)
    except ValueError as err:  # the Request's message starts with the field; say which flag set it
        field, _, rest = str(err).partition(" ")
        message = f"--{field.replace('_', '-')} {rest}" if hasattr(args, field) else str(err)
        raise UsageError(message) from None
    result = planner.plan(model, inventory.build(nodes, pods), request, calibration.load(args.calibration))
    if args.json:
        owner = render.Owner(name=model.name.replace("/", "-").lower(), namespace="default", uid="")
        print(json.dumps(render.plan_status(result, owner), indent=2))
    else:
        print(f"{result.status}: {result.message}")
        lay = result.layout
        if lay is not None:
            print(f"KV budget: {lay.kv_tokens} tokens per replica ({lay.kv_bytes_per_gpu / 2**30:.1f} GiB per GPU), "
                  f"{lay.batch_slots} batch slots, {lay.step_tokens} prompt tokens per step")
        for reason in result.reasons:
            print(f"  - {reason}")
        if result.alternatives:
            print("alternatives:")
            for alt in result.alternatives:
                figures = f" ({alt.ms_per_token:.2f} ms/token, {alt.tokens_per_s:.0f} tokens/s)" \
                    if alt.ms_per_token is not None and alt.tokens_per_s is not None else ""
                print(f"  - {alt.layout}{figures}: {alt.rejected}")
    return 0 if result.layout is not None else 1
