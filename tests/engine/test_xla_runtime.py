"""The engine's XLA runtime choices: the allocator its process prefers, the update mode of its step
programs, and where the KV pool's free-memory figure comes from."""

from __future__ import annotations

import pytest
from switchyard.service.engine.xla_runtime import (
    ALLOCATOR_ENV,
    SHORT_CHUNK_COMMAND_BUFFER,
    free_device_memory,
    prefer_virtual_memory_allocator,
    step_compiler_options,
)
from switchyard.service.modelspec import ModelSpecError

VMM = {ALLOCATOR_ENV: "vmm"}
UPDATE_MODE = "xla_gpu_command_buffer_update_mode"


def test_the_allocator_preference_is_for_one_gpu_and_keeps_the_users_choice():
    env: dict[str, str] = {}
    prefer_virtual_memory_allocator(1, env)
    assert env == {ALLOCATOR_ENV: "vmm"}
    env = {}
    prefer_virtual_memory_allocator(2, env)
    assert env == {}
    env = {ALLOCATOR_ENV: "bfc"}
    prefer_virtual_memory_allocator(1, env)
    assert env == {ALLOCATOR_ENV: "bfc"}


def test_every_gpu_step_keeps_its_temporary_buffer_in_place_under_the_virtual_memory_allocator():
    for chunk in (0, 64, 256, 2048):
        options = step_compiler_options(chunk, 256, "gpu", VMM)
        assert options is not None and options[UPDATE_MODE] == "SKIP_TEMP", chunk
    assert step_compiler_options(64, 256, "gpu", {ALLOCATOR_ENV: "VMM"}) == {
        "xla_gpu_enable_command_buffer": SHORT_CHUNK_COMMAND_BUFFER, UPDATE_MODE: "SKIP_TEMP"}
    # Not without that allocator (the mode needs it), never off GPU, and not where XLA_FLAGS choose a mode.
    assert step_compiler_options(0, 256, "gpu", {ALLOCATOR_ENV: "bfc"}) is None
    assert step_compiler_options(0, 256, "cpu", VMM) is None
    flags = {**VMM, "XLA_FLAGS": f"--{UPDATE_MODE}=ALWAYS_UPDATE"}
    assert step_compiler_options(0, 256, "gpu", flags) is None
    assert UPDATE_MODE not in step_compiler_options(64, 256, "gpu", flags)


class _Device:
    def __init__(self, platform: str, stats: dict[str, int] | None, driver: tuple[int, int] | None = None):
        self.platform, self._stats, self.driver = platform, stats, driver

    def memory_stats(self) -> dict[str, int] | None:
        return self._stats


def _driver(device: _Device) -> tuple[int, int] | None:
    return device.driver


def test_free_memory_comes_from_the_allocator_where_it_counts_and_the_driver_where_it_does_not():
    gib = 2**30
    assert free_device_memory([_Device("cpu", None)], _driver) is None
    arenas = [_Device("gpu", {"bytes_limit": 60 * gib, "bytes_in_use": 16 * gib}, (70 * gib, 80 * gib)),
              _Device("gpu", {"bytes_limit": 60 * gib, "bytes_in_use": 18 * gib}, (70 * gib, 80 * gib))]
    assert free_device_memory(arenas, _driver) == 42 * gib  # the fullest GPU's arena, not the driver's count
    vmm = [_Device("gpu", None, (63 * gib, 80 * gib)), _Device("gpu", {}, (61 * gib, 80 * gib))]
    assert free_device_memory(vmm, _driver) == 61 * gib
    with pytest.raises(ModelSpecError, match=r"^cannot size the KV pool: .* set layout\.kv_tokens$"):
        free_device_memory([_Device("gpu", None, None)], _driver)
