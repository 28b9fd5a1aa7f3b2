"""Run in a process of its own with eight host devices (see test_eight_ranks.py): the collective
layer and the engine at 8 tensor-parallel ranks, the size of an HGX node."""

from __future__ import annotations

import dataclasses
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.service.engine.checkpoint import write_checkpoint
from switchyard.service.engine.engine import Engine, EngineConfig
from switchyard.service.engine.kv_manager import KVManager
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.modelspec import ServingLayout, preset

WORLD = 8


def check_collectives() -> None:
    mesh = Mesh(np.array(jax.devices()[:WORLD]), ("tp",))
    rng = np.random.default_rng(0)
    for dtype, tol in (("float32", 1e-6), ("bfloat16", 1e-2), ("float16", 2e-3)):
        for n in (1, 7, 4097):
            xs = rng.standard_normal((WORLD, 3, n)).astype(dtype)
            res = rng.standard_normal((3, n)).astype(dtype)
            w = rng.standard_normal(n).astype(dtype)
            total = xs.astype(np.float64).sum(0)
            new_res = res.astype(np.float64) + total
            normed = w * new_res / np.sqrt(np.mean(new_res**2, -1, keepdims=True) + 1e-5)
            for strategy in kernels.STRATEGIES:
                def body(x, r, wt, strategy=strategy):
                    s = kernels.all_reduce(x[0], "tp", strategy)
                    nr, nm = kernels.all_reduce_residual_rmsnorm(x[0], r, wt, 1e-5, "tp", strategy)
                    return s[None], nr[None], nm[None]

                f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                                          out_specs=(P("tp"), P("tp"), P("tp")), check_vma=False))
                x = jax.device_put(jnp.asarray(xs), NamedSharding(mesh, P("tp")))
                s, nr, nm = (np.asarray(a, np.float64) for a in f(x, jnp.asarray(res), jnp.asarray(w)))
                for got, ref in ((s, total), (nr, new_res), (nm, normed)):
                    err = np.linalg.norm(got - ref[None]) / np.linalg.norm(ref[None].repeat(WORLD, 0))
                    assert err < tol, (dtype, n, strategy, err)
                    assert all((got[i] == got[0]).all() for i in range(WORLD)), "ranks disagree"


def check_engine() -> None:
    spec = dataclasses.replace(preset("tiny"), num_heads=8, num_kv_heads=8, head_dim=16, vocab_size=509)
    with tempfile.TemporaryDirectory() as folder:
        write_checkpoint(spec, folder, seed=1, progress=False)
        outs = {}
        for tp in (1, WORLD):
            engine = Engine.from_checkpoint(folder, ServingLayout(tp=tp, batch_slots=2, max_seq_len=64),
                                            EngineConfig(batch_slots=2, max_seq_len=64, step_tokens=16, block_size=16),
                                            progress=False)
            kv = KVManager(max_slots=2, max_seq_len=64, kv_tokens=engine.kv_tokens, block_size=16)
            kv.begin(0, [1, 5, 9, 200, 7], SamplingParams())
            tokens, logits = [], []
            while len(tokens) < 16:  # the prompt in one chunk, then a token a step
                assert kv.ensure_decode_blocks()
                plan = engine.policy.plan(kv, [0] if kv.sequence(0).left else [])
                logits.append(engine.logits(plan)[-1])
                result = engine.collect(engine.launch(plan))
                kv.launched(plan)
                tokens.append(int(result.chunk_tokens[0]) if plan.chunks else int(result.tokens[0]))
            outs[tp] = tokens, np.stack(logits)
        assert outs[1][0] == outs[WORLD][0], "TP=8 tokens differ from TP=1"
        rel = np.abs(outs[1][1] - outs[WORLD][1]).max() / np.abs(outs[1][1]).max()
        assert rel < 1e-5, rel


if __name__ == "__main__":
    assert len(jax.devices()) >= WORLD, jax.devices()
    check_collectives()
    check_engine()
    print("eight ranks: ok")
    sys.exit(0)
