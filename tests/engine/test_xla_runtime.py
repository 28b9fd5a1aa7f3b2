"""The serving engine's XLA flags: added to what the environment has, never over a user's choice."""

from switchyard.service.engine.xla_runtime import COMMAND_BUFFER_FLAG, apply_serving_flags, with_serving_flags


def test_command_buffers_take_cudnn_calls_beside_other_flags():
    flags = with_serving_flags("--xla_force_host_platform_device_count=4")
    assert flags.split() == ["--xla_force_host_platform_device_count=4", COMMAND_BUFFER_FLAG]
    assert "CUDNN" in COMMAND_BUFFER_FLAG.split("=")[1].split(",")


def test_a_users_command_buffer_setting_is_kept():
    assert with_serving_flags("--xla_gpu_enable_command_buffer=") == "--xla_gpu_enable_command_buffer="


def test_applied_to_an_environment_without_xla_flags():
    env: dict[str, str] = {}
    apply_serving_flags(env)
    assert env == {"XLA_FLAGS": COMMAND_BUFFER_FLAG}
    apply_serving_flags(env)
    assert env == {"XLA_FLAGS": COMMAND_BUFFER_FLAG}
