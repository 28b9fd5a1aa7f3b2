"""benchmarks/prefill.py on host devices: a prompt alone in the policy's chunks, a second prompt whose
prefix blocks come from the cache, and the profile's mixed load (no GPU events on host devices)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import scripts


def test_prefill_benchmark_on_the_tiny_preset(tmp_path):
    out = tmp_path / "prefill.json"
    run = subprocess.run([sys.executable, str(scripts.BENCHMARKS / "prefill.py"), "--cpu", "--model", "tiny",
                          "--prompt", "40", "--step-tokens", "16", "--shared-prefix", "70", "--suffix", "8",
                          "--repeats", "1", "--batch-slots", "4", "--no-warmup", "--profile-decoding", "2",
                          "--profile-context", "20", "--profile-dir", str(tmp_path / "profile"), "--out", str(out)],
                         env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert {"command", "device", "date", "commit", "jax", "model", "rows"} <= set(result)
    alone, shared, profile = result["rows"]  # no warm-up row: each measure's untimed first run compiles what it runs
    # 40 tokens in 16-token chunks: nothing decodes beside them, but the idle chunk (the whole
    # 192-token table) is longer than the prompt
    assert (alone["kind"], alone["prompt"], alone["steps"]) == ("prompt alone", 40, 3) and alone["ms"] > 0
    # the default formats, named in every row
    assert {(row["weights"], row["kv_cache"]) for row in result["rows"]} == {("bf16", "auto")}
    # the prefix's whole 64-token block comes from the cache; the rest is computed
    assert shared["kind"] == "shared prefix" and shared["cached_tokens"] == 64
    assert shared["first_ms"] > 0 and shared["second_ms"] > 0
    # the profile's mixed load: two sequences seated at context 20, a 70-token prompt beside them
    assert profile["kind"] == "profile"
    assert (profile["decode_only"]["decoding"], profile["chunk_beside_decoding"]["prompt"]) == (2, 70)
    assert profile["chunk_beside_decoding"]["steps"] == 5  # 16-token chunks beside decoding sequences


def test_prefill_benchmark_times_an_fp8_kv_cache_after_the_models_dtype(tmp_path):
    out = tmp_path / "prefill.json"
    run = subprocess.run([sys.executable, str(scripts.BENCHMARKS / "prefill.py"), "--cpu", "--model", "tiny",
                          "--prompt", "40", "--step-tokens", "16", "--shared-prefix", "70", "--suffix", "8",
                          "--repeats", "1", "--batch-slots", "4", "--no-warmup", "--kv-cache", "auto", "fp8",
                          "--out", str(out)],
                         env=dict(os.environ, PYTHONSAFEPATH="1"), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(row["kind"], row["kv_cache"]) for row in rows] == [
        ("prompt alone", "auto"), ("shared prefix", "auto"), ("prompt alone", "fp8"), ("shared prefix", "fp8")]
    assert all(row.get("ms", row.get("second_ms", 0)) > 0 for row in rows)
    assert rows[2]["steps"] == rows[0]["steps"] == 3  # the same chunks whatever the pool holds
    assert rows[3]["cached_tokens"] == rows[1]["cached_tokens"] == 64
