"""Pipeline stages in one process: the one engine over a (pp, tp) mesh of simulated devices gives
exactly TP=1's tokens (greedy and sampled), with prompts in chunks over the paged pool (several to a
step among them) and requests joining and leaving; its logits match one device's; bad pipeline shapes
are refused."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers.engine_fixtures import greedy_and_logits, tiny_engine, varied_checkpoint
from switchyard.service.engine.engine import Engine
from switchyard.service.engine.request import GenerationRequest
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import Scheduler
from switchyard.service.modelspec import ModelSpec, ServingLayout

REQUESTS = [
    ([1, 40, 41, 42], 9, SamplingParams()),
    ([1, 7, 300, 12, 99, 5], 12, SamplingParams(temperature=0.9, seed=3)),
    ([1, 250], 5, SamplingParams(temperature=1.1, top_k=30, seed=8)),
    ([1, *range(3, 30)], 7, SamplingParams()),
    ([1, 77, 78], 11, SamplingParams(temperature=0.7, top_p=0.9, seed=1)),
    ([1, 500, 501, 502, 503], 6, SamplingParams()),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_checkpoint_dir):
    return varied_checkpoint(tmp_path_factory.mktemp("pp-model"), tiny_checkpoint_dir)


def serve_all(engine) -> dict[str, list[int]]:
    sched = Scheduler(engine, max_queue=16)
    out: dict[str, list[int]] = {}
    for i, (prompt, n, sampling) in enumerate(REQUESTS):
        sched.submit(GenerationRequest(f"r{i}", prompt, n, sampling, ignore_eos=True,
                                       on_event=lambda e: e.token_id is not None and out.setdefault(
                                           e.request_id, []).append(e.token_id)))
    for _ in range(2000):
        if not sched.step() and sched.in_flight == 0:
            break
    assert sched.in_flight == 0 and sched.kv.held_blocks() == 0
    return out


@pytest.fixture(scope="module")
def reference(checkpoint):
    tokens = serve_all(tiny_engine(checkpoint, slots=4, max_seq_len=64, step_tokens=8, block_size=8))
    assert len({tuple(t) for t in tokens.values()}) == len(REQUESTS), "requests should differ"
    return tokens


# The warm-up compiles every shape the step policy can ask for, which takes most of a case's time; one
# layout with both kinds of parallelism checks that it covers what serving runs. Four stages: the middle
# ones receive and pass on; with blocks of 4 and a budget of 16, the short prompts' chunks share steps.
@pytest.mark.parametrize(("pp", "tp", "warm", "step_tokens", "block_size"), [(2, 2, True, 8, 8), (4, 1, False, 16, 4)])
def test_pipeline_stages_give_the_tokens_of_one_device(checkpoint, reference, pp, tp, warm, step_tokens, block_size):
    engine = tiny_engine(checkpoint, tp=tp, pp=pp, slots=4, max_seq_len=64, step_tokens=step_tokens,
                         block_size=block_size)
    if warm:
        engine.warmup()
    compiled = engine.compiled_count()
    plans = []
    launch = engine.launch
    engine.launch = lambda plan: (plans.append(plan), launch(plan))[1]
    assert serve_all(engine) == reference
    if warm:
        assert engine.compiled_count() == compiled, "serving compiled a program the warm-up missed"
    assert any(len(p.chunks) > 1 for p in plans) == (engine.policy.packed_chunks > 1)


def test_pipeline_logits_match_one_device(checkpoint):
    prompt = [1, 5, 9, 200, 7, 33, 90, 91, 92, 93, 94]
    one = greedy_and_logits(tiny_engine(checkpoint, slots=2, max_seq_len=64, step_tokens=8, block_size=8), prompt, 4)
    two = greedy_and_logits(tiny_engine(checkpoint, tp=2, pp=2, slots=2, max_seq_len=64, step_tokens=8, block_size=8),
                            prompt, 4)
    assert one[0] == two[0]
    assert np.abs(one[1] - two[1]).max() / np.abs(one[1]).max() < 1e-5


def test_bad_pipeline_shapes_are_refused(checkpoint):
    with pytest.raises(ValueError, match="3 pipeline stages must divide the 4 layers"):
        tiny_engine(checkpoint, pp=3, slots=3, max_seq_len=64)
    with pytest.raises(ValueError, match="needs 8 devices; 4 are visible"):
        tiny_engine(checkpoint, tp=4, pp=2, slots=2, max_seq_len=64)


def test_random_weights_are_laid_out_as_a_loaded_checkpoint(checkpoint):
    """Benchmarks build engines from random weights: same tree, shapes, dtypes and shardings as a load."""
    layout = ServingLayout(tp=2, pp=2, batch_slots=4, max_seq_len=64)
    loaded = tiny_engine(checkpoint, tp=2, pp=2, slots=4, max_seq_len=64)
    made = Engine.from_random(ModelSpec.from_file(checkpoint), layout, loaded.config)

    def described(engine):
        return jax.tree.map(lambda a: (a.shape, str(a.dtype), a.sharding.spec), engine.params)

    assert described(made) == described(loaded)
    norms = [float(layer["attn_norm"].mean()) for layer in made.params["layers"]]
    assert all(0.9 < n < 1.1 for n in norms), "norm weights should sit near 1, as a trained model's"
    assert float(abs(made.params["lm_head"]).mean()) < 0.1
