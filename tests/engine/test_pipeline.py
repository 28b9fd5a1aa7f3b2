"""Pipeline parallelism in one process: stages on simulated devices give exactly TP=1's tokens,
with requests joining and leaving while micro-batches are in flight."""

from __future__ import annotations

import pytest
from helpers import scripts
from helpers.engine_fixtures import varied_checkpoint
from switchyard.service.engine.pipeline import PipelineEngine
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import GenerationRequest, Scheduler
from switchyard.service.engine.tensor_parallel import Engine
from switchyard.service.engine.tokenizer import Tokenizer
from switchyard.service.modelspec import ServingLayout

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
    tok = Tokenizer.from_dir(engine_folder(engine))
    sched = Scheduler(engine, tok, max_queue=16)
    out: dict[str, list[int]] = {}
    for i, (prompt, n, sampling) in enumerate(REQUESTS):
        sched.submit(GenerationRequest(f"r{i}", prompt, n, sampling, ignore_eos=True,
                                       on_event=lambda e: e.token_id is not None and out.setdefault(
                                           e.request_id, []).append(e.token_id)))
    for _ in range(2000):
        if not sched.step() and sched.in_flight == 0:
            break
    assert sched.in_flight == 0 and engine.free_slots() == list(range(engine.max_slots))
    return out


_FOLDERS: dict[int, str] = {}


def engine_folder(engine) -> str:
    return _FOLDERS[id(engine)]


@pytest.fixture(scope="module")
def reference(checkpoint):
    engine = Engine.from_checkpoint(checkpoint, ServingLayout(tp=1, batch_slots=4, max_seq_len=64), progress=False)
    _FOLDERS[id(engine)] = checkpoint
    tokens = serve_all(engine)
    assert len({tuple(t) for t in tokens.values()}) == len(REQUESTS), "requests should differ"
    return tokens


@pytest.mark.parametrize(("pp", "tp"), [(2, 1), (2, 2), (4, 1)])
def test_pipeline_stages_give_the_tokens_of_one_device(checkpoint, reference, pp, tp):
    engine = PipelineEngine.from_checkpoint(checkpoint, ServingLayout(tp=tp, pp=pp, batch_slots=4, max_seq_len=64),
                                            progress=False)
    _FOLDERS[id(engine)] = checkpoint
    engine.warmup()
    compiled = engine.compiled_count()
    assert serve_all(engine) == reference
    assert engine.compiled_count() == compiled, "serving compiled a program the warm-up missed"


def test_pipeline_prefill_logits_match_one_device(checkpoint):
    import numpy as np

    one = Engine.from_checkpoint(checkpoint, ServingLayout(tp=1, batch_slots=2, max_seq_len=64), progress=False)
    two = PipelineEngine.from_checkpoint(checkpoint, ServingLayout(tp=2, pp=2, batch_slots=2, max_seq_len=64),
                                         progress=False)
    prompt = [1, 5, 9, 200, 7, 33]
    a = np.asarray(one.prefill(prompt, return_logits=True).logits)[:512]
    b = np.asarray(two.prefill(prompt, return_logits=True).logits)[:512]
    assert np.abs(a - b).max() / np.abs(a).max() < 1e-5


def test_bad_pipeline_shapes_are_refused(checkpoint):
    with pytest.raises(ValueError, match="must be a multiple of the 2 pipeline stages"):
        PipelineEngine.from_checkpoint(checkpoint, ServingLayout(tp=1, pp=2, batch_slots=3, max_seq_len=64),
                                       progress=False)
    with pytest.raises(ValueError, match="3 pipeline stages must divide the 4 layers"):
        PipelineEngine.from_checkpoint(checkpoint, ServingLayout(tp=1, pp=3, batch_slots=3, max_seq_len=64),
                                       progress=False)


def test_random_weights_are_laid_out_as_a_loaded_checkpoint(checkpoint):
    """Benchmarks build pipelines from random weights: same tree, shapes, dtypes and shardings as a load."""
    import jax
    from switchyard.service.modelspec import ModelSpec

    layout = ServingLayout(tp=2, pp=2, batch_slots=4, max_seq_len=64)
    loaded = PipelineEngine.from_checkpoint(checkpoint, layout, progress=False)
    spec = ModelSpec.from_file(checkpoint)
    made = PipelineEngine.from_random(spec, layout, dtype=loaded.dtype)

    def described(engine):
        return jax.tree.map(lambda a: (a.shape, str(a.dtype), a.sharding.spec), engine.params)

    assert described(made) == described(loaded)
    norms = [float(layer["attn_norm"].mean()) for layer in made.params["layers"]]
    assert all(0.9 < n < 1.1 for n in norms), "norm weights should sit near 1, as a trained model's"
    assert float(abs(made.params["lm_head"]).mean()) < 0.1


def test_occupied_slots_get_a_token_every_pp_ticks(checkpoint):
    import numpy as np
    from switchyard.service.modelspec import ModelSpec

    spec = ModelSpec.from_file(checkpoint)
    variants = scripts.load("variants")
    engine = variants.VariantPipelineEngine.from_random(spec, ServingLayout(tp=1, pp=2, batch_slots=4, max_seq_len=64))
    engine.occupy_slots(10, count=3)  # micro-batches {0, 1} (both active) and {2, 3} (slot 3 idle)
    emitted = [engine.generate().active for _ in range(5)]
    assert not emitted[0].any(), "tick 0 only fills the pipeline"
    assert [np.flatnonzero(a).tolist() for a in emitted[1:]] == [[0, 1], [2], [0, 1], [2]]
    assert engine.positions.tolist() == [12, 12, 12, 10]
