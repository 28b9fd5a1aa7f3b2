import json

import pytest
from switchyard.service.modelspec import (
    KV_BLOCK_TOKENS,
    PRESETS,
    ModelSpec,
    ModelSpecError,
    ServingLayout,
    kv_tokens_for_memory,
    preset,
)


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
        ({"model_type": "gpt2"}, r"model_type 'gpt2' is not supported \(supported: llama, mistral, qwen2, qwen3\)"),
        ({"num_key_value_heads": 3}, "must be a multiple of num_key_value_heads"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"vocab_size": 0}, r"vocab_size must be an integer in \[2, 1048576\], got 0"),
        ({"torch_dtype": "int8"}, "torch_dtype must be one of"),
        ({"num_hidden_layers": 2**63 - 1}, r"num_hidden_layers must be an integer in \[1, 1024\]"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
        ({"hidden_size": 4, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": None},
         r"hidden_size \(4\) is smaller than num_attention_heads \(8\)"),
        ({"head_dim": 15}, "head_dim must be even"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}},
         "low_freq_factor .* must be below rope_scaling.high_freq_factor"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number"),
        ({"rope_theta": float("nan")}, "rope_theta must be a number"),
        ({"eos_token_id": 10**6}, "eos_token_id must be token ids in"),
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


def test_serving_layout_kv_pool_and_step_fields():
    default = ServingLayout()
    assert (default.kv_tokens, default.kv_memory_fraction, default.step_tokens) == (0, 0.9, 256)
    layout = ServingLayout(max_seq_len=2048, kv_tokens=40 * KV_BLOCK_TOKENS, kv_memory_fraction=0.5,
                           step_tokens=512)
    again = ServingLayout.from_json(layout.to_json())
    assert again == layout and (again.kv_tokens, again.kv_memory_fraction, again.step_tokens) == (2560, 0.5, 512)
    assert ServingLayout(max_seq_len=100, kv_tokens=128).kv_tokens == 128  # one sequence of 100 fits
    assert ServingLayout(kv_memory_fraction=0.95).kv_memory_fraction == 0.95
    assert default.join_timeout_s == 30.0
    assert ServingLayout.from_json(ServingLayout(join_timeout_s=600).to_json()).join_timeout_s == 600


@pytest.mark.parametrize("fields, message", [
    ({"kv_tokens": -64}, "kv_tokens must be a whole number of tokens, 0 or more"),
    ({"kv_tokens": 1.5}, "kv_tokens must be a whole number"),
    ({"kv_tokens": True}, "kv_tokens must be a whole number"),
    ({"kv_tokens": 4100}, "kv_tokens must be a multiple of 64"),
    ({"kv_tokens": 1024, "max_seq_len": 2048}, r"kv_tokens \(1024\) must hold one full-length sequence: at least "
                                                r"layout.max_seq_len \(2048\)"),
    ({"kv_memory_fraction": 0}, r"kv_memory_fraction must be a number in \(0, 0.95\], got 0"),
    ({"kv_memory_fraction": 0.96}, "kv_memory_fraction must be a number in"),
    ({"kv_memory_fraction": float("nan")}, "kv_memory_fraction must be a number in"),
    ({"kv_memory_fraction": "0.5"}, "kv_memory_fraction must be a number in"),
    ({"step_tokens": 8}, "step_tokens must be a multiple of 16 and at least 16, got 8"),
    ({"step_tokens": 100}, "step_tokens must be a multiple of 16"),
    ({"step_tokens": 0}, "step_tokens must be a positive integer"),
    ({"join_timeout_s": 0}, "join_timeout_s must be a positive number of seconds, got 0"),
    ({"join_timeout_s": -5}, "join_timeout_s must be a positive number"),
    ({"join_timeout_s": float("nan")}, "join_timeout_s must be a positive number"),
    ({"join_timeout_s": float("inf")}, "join_timeout_s must be a positive number"),
    ({"join_timeout_s": "30"}, "join_timeout_s must be a positive number"),
    ({"join_timeout_s": True}, "join_timeout_s must be a positive number"),
])
def test_serving_layout_rejects_bad_kv_step_and_join_fields(fields, message):
    with pytest.raises(ModelSpecError, match=message):
        ServingLayout(**fields)
    with pytest.raises(ModelSpecError, match=message):
        ServingLayout.from_json(json.dumps({"max_seq_len": 2048, **fields}))


def test_kv_bytes_per_gpu_are_the_gpus_share_of_heads_and_layers():
    spec = preset("llama3-70b")  # 80 layers, 8 KV heads of 128, bfloat16
    assert spec.kv_bytes_per_token_per_gpu(1, 1) == spec.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert spec.kv_bytes_per_token_per_gpu(8, 1) == 2 * 80 * 1 * 128 * 2
    assert spec.kv_bytes_per_token_per_gpu(2, 4) == 2 * 20 * 4 * 128 * 2
    assert spec.kv_bytes_per_token_per_gpu(1, 1, "float32") == 2 * spec.kv_bytes_per_token
    for tp, pp in ((3, 1), (16, 1), (0, 1), (1, 3), (1, 0)):
        with pytest.raises(ModelSpecError, match="must be a positive integer dividing"):
            spec.kv_bytes_per_token_per_gpu(tp, pp)
    with pytest.raises(ModelSpecError, match="dtype must be one of"):
        spec.kv_bytes_per_token_per_gpu(1, 1, "int4")


def test_kv_tokens_for_memory_counts_whole_blocks_of_the_gpus_share():
    spec = preset("llama3-8b")  # 32 layers, 8 KV heads of 128: 128 KiB per token in bfloat16
    per_token = spec.kv_bytes_per_token
    block = per_token * KV_BLOCK_TOKENS
    assert kv_tokens_for_memory(spec, 1, 1, 10 * block, "bfloat16") == 10 * KV_BLOCK_TOKENS
    assert kv_tokens_for_memory(spec, 1, 1, 10 * block - 1, "bfloat16") == 9 * KV_BLOCK_TOKENS
    assert kv_tokens_for_memory(spec, 1, 1, block - 1, "bfloat16") == 0  # less than one block
    # A GPU holding a quarter of the heads and half of the layers fits 8x the tokens in the same bytes.
    assert kv_tokens_for_memory(spec, 4, 2, 10 * block, "bfloat16") == 80 * KV_BLOCK_TOKENS
    # float32 entries take twice the room; the model's own dtype is the default.
    assert kv_tokens_for_memory(spec, 1, 1, 10 * block, "float32") == 5 * KV_BLOCK_TOKENS
    assert kv_tokens_for_memory(spec, 1, 1, 10 * block) == 10 * KV_BLOCK_TOKENS
    gib80 = 80 * 2**30
    assert kv_tokens_for_memory(spec, 1, 1, gib80, "bfloat16") == gib80 // per_token // 64 * 64 == 655360
    for free in (0, -1, -(10**12)):
        assert kv_tokens_for_memory(spec, 1, 1, free, "bfloat16") == 0
    for tokens in (kv_tokens_for_memory(spec, tp, pp, 12345678901, "bfloat16") for tp in (1, 2, 4, 8)
                   for pp in (1, 2, 4, 8, 16, 32)):
        assert tokens % KV_BLOCK_TOKENS == 0 and tokens > 0


def test_kv_tokens_for_memory_rejects_what_no_gpu_can_hold():
    spec = preset("llama3-8b")
    with pytest.raises(ModelSpecError, match="tp must be"):
        kv_tokens_for_memory(spec, 3, 1, 2**30, "bfloat16")
    with pytest.raises(ModelSpecError, match="pp must be"):
        kv_tokens_for_memory(spec, 1, 5, 2**30, "bfloat16")
    with pytest.raises(ModelSpecError, match="dtype must be one of"):
        kv_tokens_for_memory(spec, 1, 1, 2**30, "int8")
    for free in (float("inf"), float("nan"), "1GiB", None, True):
        with pytest.raises(ModelSpecError, match="free_bytes_per_gpu must be a finite number"):
            kv_tokens_for_memory(spec, 1, 1, free, "bfloat16")
