"""Every family served by the engine against transformers on the same weights: fp32
logits within tolerance and 32 greedy tokens identical, at tensor-parallel sizes 1, 2 and 4 (where
the heads divide), from checkpoints written by ``save_pretrained``; and the random-weight checkpoints
``make-checkpoint`` writes for each family are what transformers loads (every tensor named and shaped
as the family's model has it)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from helpers.engine_fixtures import greedy_and_logits, tiny_engine
from helpers.hf_reference import hf_greedy, hf_logits, hf_model, save_hf
from switchyard.cli.main import main as cli
from switchyard.service.modelspec import ModelSpec, RopeScaling, preset
from transformers import AutoModelForCausalLM

# Two layers each: compiling is most of these tests' time, and it grows with the layers.
CONFIGS = {
    # Llama 3.2's shape: tied embeddings, llama3 rope scaling, head_dim given apart from hidden / heads.
    "llama3.2": dataclasses.replace(preset("tiny"), tie_word_embeddings=True, head_dim=32, num_layers=2),
    "mistral": dataclasses.replace(preset("tiny-mistral"), num_layers=2),
    "qwen2": dataclasses.replace(preset("tiny-qwen2"), num_layers=2),  # QKV biases, GQA 4:1, tied embeddings
    "qwen3": dataclasses.replace(preset("tiny-qwen3"), num_layers=2, rope_scaling=RopeScaling("linear", 2.0)),
}
PROMPT = [1, 5, 17, 99, 3, 250, 7]  # two chunks of 4: the second, short, attends to the first one's block
N_TOKENS = 32
CASES = [(name, tp) for name, spec in CONFIGS.items() for tp in (1, 2, 4) if spec.valid_tp(tp)]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict:
    """name -> (transformers model, its save_pretrained folder), made on first use."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            model = hf_model(CONFIGS[name], seed=len(name))
            made[name] = model, save_hf(model, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_fp32_logits_and_greedy_tokens_match_transformers(references, name, tp):
    model, folder = references(name)
    assert ModelSpec.from_file(folder).model_type == CONFIGS[name].model_type
    # The prompt in chunks of 4 tokens over blocks of 4 positions: chunks cross blocks and attend to earlier ones.
    engine = tiny_engine(folder, tp=tp, slots=2, max_seq_len=64, step_tokens=4, block_size=4)
    tokens, logits = greedy_and_logits(engine, PROMPT, N_TOKENS)
    assert tokens == hf_greedy(model, PROMPT, N_TOKENS)
    expected = hf_logits(model, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    rel = np.abs(logits - expected).max() / np.abs(expected).max()
    assert rel < 2e-5, f"fp32 logits differ from transformers by {rel:.2e} (relative to max |logit|)"


@pytest.mark.parametrize("name", ["tiny-mistral", "tiny-qwen2", "tiny-qwen3"])
def test_make_checkpoint_writes_each_family_as_transformers_loads_it(tmp_path, name, capsys):
    folder = tmp_path / name
    assert cli(["make-checkpoint", "--preset", name, "--out", str(folder), "--seed", "3"]) == 0
    assert f"wrote {name}" in capsys.readouterr().out
    hf, info = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert type(hf).__name__ == preset(name).family.architectures[0]
    assert not any(info.values()), info  # no tensor missing, unexpected or mismatched
    biases = [n for n, _ in hf.named_parameters() if n.endswith("_proj.bias")]
    assert bool(biases) == (name == "tiny-qwen2")
    assert ModelSpec.from_file(folder) == preset(name)
