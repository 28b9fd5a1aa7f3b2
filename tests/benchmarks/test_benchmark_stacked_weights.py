"""benchmarks/stacked_weights.py on host devices: every layout's sum agrees with the buffers', every
matrix, kind, layout and row count is timed, and the copy counter reads what a compiled program
materialises outside its fusions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import cpu_xla_flags, scripts

SCRIPT = scripts.BENCHMARKS / "stacked_weights.py"

HLO = """\
%fused_computation (p: bf16[2,64,96]) -> bf16[64,96] {
  %p = bf16[2,64,96]{2,1,0} parameter(0)
  %s = bf16[1,64,96]{2,1,0} slice(%p), slice={[0:1], [0:64], [0:96]}
  ROOT %b = bf16[64,96]{1,0} bitcast(%s)
}

%body (t: (s32[], f32[2,96])) -> (s32[], f32[2,96]) {
  %t = (s32[], f32[2,96]{1,0}) parameter(0)
  %ds = bf16[1,64,96]{2,1,0} dynamic-slice(%w, %i, %z, %z), dynamic_slice_sizes={1,64,96}
  ROOT %r = (s32[], f32[2,96]{1,0}) tuple(%i, %acc)
}

ENTRY %main (x: bf16[2,64], w: bf16[2,64,96]) -> f32[2,96] {
  %w = bf16[2,64,96]{2,1,0} parameter(1)
  %one = bf16[64,96]{1,0} parameter(2)
  %copy_fusion = bf16[64,96]{1,0} fusion(%w), kind=kLoop, calls=%fused_computation
  %view = bf16[64,96]{1,0} bitcast(%copy_fusion)
  ROOT %dot = f32[2,96]{1,0} custom-call(%x, %copy_fusion), custom_call_target="__cublas$gemm"
}
"""


def test_the_copy_counter_reads_entry_and_loop_bodies_not_fusions():
    sw = scripts.load("stacked_weights")
    # The entry's copy fusion and the loop body's dynamic slice; not the parameter, the bitcast, nor
    # the slice inside the fusion's own body.
    assert sw.weight_copies(HLO, 64, 96) == 2
    assert sw.weight_copies(HLO, 64, 95) == 0


def test_stacked_weights_benchmark_times_every_layout_and_checks_it(tmp_path):
    out = tmp_path / "stacked.json"
    env = dict(os.environ, PYTHONSAFEPATH="1", XLA_FLAGS=cpu_xla_flags(1))
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--rows", "2", "--layers", "2",
                          "--repeats", "2", "--out", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["checks_passed"] and "all checks passed" in run.stdout
    seen = {(r["matrix"], r["kind"], r["layout"], r["rows"]) for r in result["products"]}
    assert seen == {(m, k, lay, 2) for m in ("qkv", "o", "gate_up", "down") for k in ("bf16", "w8a16")
                    for lay in ("buffers", "slices", "scan")}
    assert all(r["ok"] and r["us_per_product"] > 0 and r["weight_copies"] >= 0 for r in result["products"])
    assert result["layers"] == 2 and result["commit"]
