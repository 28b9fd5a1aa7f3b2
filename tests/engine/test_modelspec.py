import json

import pytest
from switchyard.service.modelspec import PRESETS, ModelSpec, ModelSpecError, ServingLayout, preset


def test_llama3_8b_sizes_match_the_published_parameter_count():
    spec = preset("llama3-8b")
    assert spec.param_count == 8_030_261_248
    assert spec.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, bf16
    assert spec.allreduce_bytes(batch=1) == 4096 * 2


def test_llama3_70b_and_405b_parameter_counts():
    assert round(preset("llama3-70b").param_count / 1e9, 1) == 70.6
    assert round(preset("llama3.1-405b").param_count / 1e9, 1) == 405.9


def test_decode_bytes_count_weights_once_and_kv_per_sequence():
    spec = preset("llama3-8b")
    one = spec.decode_bytes_per_step(batch=1, context=1024)
    eight = spec.decode_bytes_per_step(batch=8, context=1024)
    assert eight - one == 7 * (1024 * spec.kv_bytes_per_token + spec.hidden_size * 2)
    embed = spec.vocab_size * spec.hidden_size * 2
    assert one == spec.param_bytes - embed + spec.hidden_size * 2 + 1024 * spec.kv_bytes_per_token


def test_config_round_trip_for_every_preset():
    for spec in PRESETS.values():
        again = ModelSpec.from_config(spec.to_config(), name=spec.name)
        assert again == spec


def test_transformers5_rope_parameters_are_read():
    config = preset("tiny").to_config()
    rope = {"rope_theta": 123.0, **config.pop("rope_scaling")}
    config.pop("rope_theta")
    config["rope_parameters"] = rope
    spec = ModelSpec.from_config(config)
    assert spec.rope_theta == 123.0
    assert spec.rope_scaling == preset("tiny").rope_scaling


def test_head_dim_defaults_to_hidden_over_heads():
    config = preset("llama3-8b").to_config()
    del config["head_dim"]
    assert ModelSpec.from_config(config).head_dim == 128


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "mistral"}, "model_type 'mistral' is not supported"),
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer"),
        ({"torch_dtype": "int8"}, "dtype must be one of"),
    ],
)
def test_bad_configs_are_rejected_with_a_reason(change, message):
    config = {**preset("tiny").to_config(), **change}
    with pytest.raises(ModelSpecError, match=message):
        ModelSpec.from_config(config)


def test_missing_fields_are_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ModelSpecError, match="lacks required fields: vocab_size, intermediate_size"):
        ModelSpec.from_file(tmp_path)


def test_valid_tp_needs_both_head_counts_divisible():
    spec = preset("llama3-70b")
    assert [tp for tp in range(1, 17) if spec.valid_tp(tp)] == [1, 2, 4, 8]


def test_serving_layout_round_trip_and_errors():
    layout = ServingLayout(tp=2, strategy="oneshot", batch_slots=16, max_seq_len=4096, model_name="m")
    assert ServingLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ModelSpecError, match="unknown fields: bogus"):
        ServingLayout.from_json('{"bogus": 1}')
    with pytest.raises(ModelSpecError, match="strategy must be one of"):
        ServingLayout(strategy="nccl")
    with pytest.raises(ModelSpecError, match="tp must be a positive integer"):
        ServingLayout(tp=0)
