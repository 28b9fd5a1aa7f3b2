"""`switchyard plan` prints the planner's decision and reasons; `switchyard operator` wires kopf."""

from __future__ import annotations

import json
import sys

import pytest
from helpers import HELPERS
from switchyard.cli import operator as operator_main
from switchyard.cli import plan as plan_cli
from switchyard.cli.main import main
from switchyard.operator import inventory, planner
from switchyard.service.modelspec import ModelSpec, preset

NODES = HELPERS / "kube" / "nodes-hgx.yaml"


def test_plan_prints_the_same_decision_as_the_planner(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(preset("llama3-70b").to_config()))
    rc = main(["plan", "--model", str(config), "--nodes", str(NODES), "--objective", "latency"])
    out = capsys.readouterr().out
    assert rc == 0
    expected = planner.plan(ModelSpec.from_file(config), inventory.build(plan_cli.load_objects(NODES)),
                            planner.Request(objective="latency"))
    assert out.splitlines()[0] == f"Planned: {expected.message}"
    for reason in expected.reasons:
        assert f"  - {reason}" in out
    assert "TP8xPP1xDP1 NVIDIA-H200" in out and "alternatives:" in out


def test_plan_json_and_does_not_fit(capsys):
    rc = main(["plan", "--model", "llama3.1-405b", "--nodes", str(NODES), "--objective", "throughput", "--json"])
    status = json.loads(capsys.readouterr().out)
    assert rc == 0 and status["layout"]["pp"] >= 1 and status["estimate"]["tokensPerSecond"] > 0
    one_node = [n for n in plan_cli.load_objects(NODES) if "h100" in n["metadata"]["name"]]
    p = planner.plan(preset("llama3.1-405b"), inventory.build(one_node), planner.Request())
    assert p.layout is None
    rc = main(["plan", "--model", "nope.json", "--nodes", str(NODES)])
    assert rc == 2 and "is neither a file or folder nor a preset" in capsys.readouterr().err


def test_plan_prices_the_weights_in_the_format_asked_for(capsys):
    """--quantization is spec.model.quantization: fp8 quantizes a 16-bit checkpoint at load, and the
    decision is the planner's for the model so served; a format it does not know is a usage error."""
    args = ["plan", "--model", "llama3-70b", "--nodes", str(NODES), "--tp", "2", "--pp", "1", "--objective", "latency"]
    estimates = {}
    for quantization in ("auto", "fp8"):
        assert main([*args, "--quantization", quantization]) == 0
        out = capsys.readouterr().out
        expected = planner.plan(preset("llama3-70b").served_as(quantization),
                                inventory.build(plan_cli.load_objects(NODES)),
                                planner.Request(objective="latency", tp=2, pp=1))
        assert out.splitlines()[0] == f"Planned: {expected.message}"
        estimates[quantization] = expected.layout.ms_per_token
    assert "weights (fp8 e4m3" in out
    assert estimates["fp8"] < 0.7 * estimates["auto"]  # half the weight bytes per step
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--quantization", "int4"])
    assert exit_info.value.code == 2 and "--quantization: invalid choice: 'int4'" in capsys.readouterr().err


def test_operator_command_configuration(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    operator_main.add_arguments(parser)
    args = parser.parse_args(["--service-image", "registry/sy:1", "--replan-interval", "30", "--standalone"])
    config = operator_main.config_from_args(args)
    assert config.render.switchyard_image == "registry/sy:1" and config.replan_interval_s == 30
    assert config.peering_name is None
    args = parser.parse_args([])
    assert operator_main.config_from_args(args).peering_name == "switchyard"
    # The command line stays light: the operator modules import no kopf until they run.
    import subprocess

    code = "import sys, switchyard.cli.operator, switchyard.cli.plan; print('kopf' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_the_compile_cache_folder_is_absolute_or_a_one_line_mistake(capsys):
    assert main(["operator", "--compile-cache-path", "var/cache/switchyard", "--standalone"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("switchyard operator: error: --compile-cache-path 'var/cache/switchyard' is not an absolute "
                           "folder path (a folder on each node)"), err


def test_operator_replicas_draw_distinct_priorities():
    from switchyard.cli.operator import priority

    assert priority("7") == 7
    drawn = {priority("random") for _ in range(20)}
    assert len(drawn) == 20 and all(p > 0 for p in drawn)



def test_plan_command_defaults_are_the_crd_defaults():
    import argparse

    from switchyard.operator import crd

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    args = parser.parse_args(["--model", "llama3-8b", "--nodes", str(NODES)])
    assert (args.objective, args.input_tokens, args.output_tokens, args.concurrency, args.strategy) == (
        crd.spec_default("objective"), crd.spec_default("workload.inputTokens"),
        crd.spec_default("workload.outputTokens"), crd.spec_default("workload.concurrency"),
        crd.spec_default("allReduce"))
