"""The model families: which config.json each takes, the shape it reads from it, its tensors, and
the bytes the planner prices, against transformers' own models of the same configs."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.hf_reference import hf_config
from switchyard.service.model import FAMILIES, family_for_config
from switchyard.service.model.family import EMBED, FINAL_NORM, LM_HEAD
from switchyard.service.modelspec import ModelSpec, ModelSpecError, check_context, preset
from transformers import AutoModelForCausalLM

TINY = {"llama": "tiny", "mistral": "tiny-mistral", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3"}
SMALL_QWEN3 = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 1800, "intermediate_size": 64,
               "num_hidden_layers": 2, "num_attention_heads": 40, "num_key_value_heads": 8}


def meta_model(spec: ModelSpec) -> torch.nn.Module:
    """transformers' model of the spec's config, with no memory behind its tensors."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(spec))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_is_found_by_model_type_then_by_architectures(family):
    config = preset(TINY[family]).to_config()
    assert ModelSpec.from_config(config).model_type == family
    del config["model_type"]
    assert family_for_config(config).name == family
    del config["architectures"]
    assert ModelSpec.from_config(config).model_type == "llama"  # config files older than model_type


def test_an_unsupported_model_type_gets_one_line_naming_the_supported_ones():
    config = {**preset("tiny").to_config(), "model_type": "gpt_neox"}
    with pytest.raises(ModelSpecError) as err:
        ModelSpec.from_config(config)
    assert str(err.value) == "model_type 'gpt_neox' is not supported (supported: llama, mistral, qwen2, qwen3)"
    del config["model_type"]
    config["architectures"] = ["GPTNeoXForCausalLM"]
    with pytest.raises(ModelSpecError, match=r"architectures \['GPTNeoXForCausalLM'\] are not supported "
                                             r"\(supported: LlamaForCausalLM, MistralForCausalLM"):
        ModelSpec.from_config(config)
    with pytest.raises(ModelSpecError, match="model_type 'bert' is not supported"):
        dataclasses.replace(preset("tiny"), model_type="bert")


def test_each_family_reads_its_own_fields():
    qwen3 = ModelSpec.from_config(SMALL_QWEN3)
    assert qwen3.head_dim == 128 and qwen3.q_size == 40 * 128  # not hidden_size / heads = 45
    assert (qwen3.qk_norm, qwen3.attention_bias) == (True, False)
    qwen2 = ModelSpec.from_config({**SMALL_QWEN3, "model_type": "qwen2", "hidden_size": 1280})
    assert qwen2.head_dim == 32 and (qwen2.qk_norm, qwen2.attention_bias) == (False, True)
    for family in ("llama", "mistral"):
        spec = ModelSpec.from_config({**SMALL_QWEN3, "model_type": family, "hidden_size": 1280})
        assert (spec.head_dim, spec.qk_norm, spec.attention_bias) == (32, False, False)


@pytest.mark.parametrize(("family", "config", "window"), [
    ("mistral", {}, 4096),  # transformers' default when the key is absent
    ("mistral", {"sliding_window": None}, None),
    ("mistral", {"sliding_window": 1024}, 1024),
    ("qwen2", {"sliding_window": 1024}, None),  # without use_sliding_window no layer slides
    ("qwen2", {"sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 1}, 1024),
    ("qwen3", {"sliding_window": 1024, "use_sliding_window": True, "max_window_layers": 2}, None),
    ("qwen3", {"sliding_window": 1024, "use_sliding_window": True, "layer_types": ["full_attention"] * 2}, None),
    ("qwen3", {"sliding_window": 1024, "use_sliding_window": True,
               "layer_types": ["full_attention", "sliding_attention"]}, 1024),
    ("llama", {"sliding_window": 1024}, None),  # Llama has no window
])
def test_the_sliding_window_is_read_as_transformers_applies_it(family, config, window):
    spec = ModelSpec.from_config({**SMALL_QWEN3, "model_type": family, "head_dim": 64, **config})
    assert spec.sliding_window == window


def test_features_the_engine_lacks_are_refused_in_one_line():
    for family in ("llama", "qwen3"):
        with pytest.raises(ModelSpecError, match=f"attention_bias is not supported for {family}: .* output"):
            ModelSpec.from_config({**SMALL_QWEN3, "model_type": family, "attention_bias": True, "head_dim": 64})
    with pytest.raises(ModelSpecError, match="mlp_bias is not supported"):
        ModelSpec.from_config({**SMALL_QWEN3, "mlp_bias": True})
    with pytest.raises(ModelSpecError, match=r"sliding_window must be an integer in \[1, 16777216\]"):
        ModelSpec.from_config({**SMALL_QWEN3, "model_type": "mistral", "head_dim": 64, "sliding_window": 0})
    with pytest.raises(ModelSpecError, match="max_window_layers must be a whole number of layers"):
        ModelSpec.from_config({**SMALL_QWEN3, "use_sliding_window": True, "sliding_window": 64,
                               "max_window_layers": "all"})


def test_a_window_shorter_than_the_context_is_refused_and_a_longer_one_serves():
    spec = dataclasses.replace(preset("tiny-mistral"), sliding_window=1024)
    check_context(spec, 1024)
    check_context(dataclasses.replace(spec, sliding_window=None), 2048)
    with pytest.raises(ModelSpecError) as err:
        check_context(spec, 2048)
    assert str(err.value) == ("tiny-mistral attends over a sliding window of 1024 tokens, which the engine does not "
                              "implement: serve it with a context (max_seq_len) of at most 1024, not 2048")


@pytest.mark.parametrize("name", ["tiny", "tiny-mistral", "tiny-qwen2", "tiny-qwen3", "llama3.1-8b", "mistral-7b",
                                  "qwen2.5-7b", "qwen3-8b"])
def test_parameter_bytes_are_the_sum_of_the_hf_models_tensors(name):
    spec = preset(name)
    model = meta_model(spec)
    hf_count = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    assert spec.param_count == hf_count
    assert spec.param_bytes == hf_count * spec.dtype_bytes
    extra = spec.family.extra_layer_params(spec)
    assert extra == {"llama": 0, "mistral": 0, "qwen2": spec.q_size + 2 * spec.kv_size,
                     "qwen3": 2 * spec.head_dim}[spec.model_type]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_family_names_every_tensor_of_the_hf_model_with_its_shape(family):
    spec = preset(TINY[family])
    hf = {name: tuple(p.shape) for name, p in meta_model(spec).named_parameters()}
    ours = {EMBED: (spec.vocab_size, spec.hidden_size), FINAL_NORM: (spec.hidden_size,)}
    if not spec.tie_word_embeddings:
        ours[LM_HEAD] = (spec.vocab_size, spec.hidden_size)
    for i in range(spec.num_layers):
        shapes = spec.family.layer_shapes(spec)
        ours.update({name: shapes[role] for role, name in spec.family.layer_names(i).items()})
    assert ours == hf
    assert spec.layer_params == sum(math.prod(s) for s in shapes.values())
