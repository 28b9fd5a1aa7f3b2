"""The engine's XLA runtime choices: the allocator its process prefers, the update mode of its step
programs, and where the KV pool's free-memory figure comes from."""

from __future__ import annotations

import pytest
from switchyard.service.engine.xla_runtime import (
    ALLOCATOR_ENV,
    PROCESS_MEMORY_FRACTION,
    SHORT_CHUNK_COMMAND_BUFFER,
    apply_process_defaults,
    compiler_room,
    free_device_memory,
    memory_fraction,
    step_compiler_options,
)
from switchyard.service.modelspec import RUNTIME_RESERVE_BYTES, STEP_PARAMETER_MARGIN, ModelSpecError

VMM = {ALLOCATOR_ENV: "vmm"}
UPDATE_MODE = "xla_gpu_command_buffer_update_mode"


def test_the_process_takes_the_planned_share_of_memory_through_the_virtual_memory_allocator():
    env: dict[str, str] = {}
    apply_process_defaults(env)
    assert env == {ALLOCATOR_ENV: "vmm", "XLA_CLIENT_MEM_FRACTION": "0.9"}
    assert memory_fraction(env) == PROCESS_MEMORY_FRACTION == 0.9
    # The user's choices stand, under either name JAX reads.
    for chosen in ({ALLOCATOR_ENV: "bfc", "XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"},
                   {ALLOCATOR_ENV: "cuda_async", "XLA_CLIENT_MEM_FRACTION": "0.6"}):
        env = dict(chosen)
        apply_process_defaults(env)
        assert env == chosen
    assert memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5"}) == 0.5
    assert memory_fraction({}) == 0.75  # JAX's own default


def test_the_process_share_is_what_the_planner_plans_with():
    from switchyard.operator import calibration

    headroom = float(calibration.load().models["memory_headroom_fraction"])
    assert abs(PROCESS_MEMORY_FRACTION - (1 - headroom)) < 1e-9


def test_only_short_chunk_steps_on_gpu_ask_for_cudnn_inside_command_buffers():
    assert step_compiler_options(64, 256, "gpu", {}) == {"xla_gpu_enable_command_buffer": SHORT_CHUNK_COMMAND_BUFFER,
                                                         **NO_REMAT}
    assert "CUDNN" in SHORT_CHUNK_COMMAND_BUFFER.split(",")
    for chunk in (256, 2048, 0):
        assert step_compiler_options(chunk, 256, "gpu", {}) == NO_REMAT, chunk
    assert step_compiler_options(64, 256, "cpu", {}) is None
    assert step_compiler_options(64, 256, "gpu", {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION"}) == NO_REMAT


def test_gpu_steps_skip_rematerialization_unless_xla_flags_choose_the_disabled_passes():
    for chunk in (0, 64, 256):
        assert step_compiler_options(chunk, 256, "gpu", {})["xla_disable_hlo_passes"] == "rematerialization"
        assert step_compiler_options(chunk, 256, "gpu", VMM)["xla_disable_hlo_passes"] == "rematerialization"
    flags = {"XLA_FLAGS": "--xla_disable_hlo_passes=fusion"}
    assert "xla_disable_hlo_passes" not in (step_compiler_options(64, 256, "gpu", flags) or {})


def test_every_gpu_step_keeps_its_temporary_buffer_in_place_under_the_virtual_memory_allocator():
    for chunk in (0, 64, 256, 2048):
        options = step_compiler_options(chunk, 256, "gpu", VMM)
        assert options is not None and options[UPDATE_MODE] == "SKIP_TEMP", chunk
    assert step_compiler_options(64, 256, "gpu", {ALLOCATOR_ENV: "VMM"}) == {
        "xla_gpu_enable_command_buffer": SHORT_CHUNK_COMMAND_BUFFER, UPDATE_MODE: "SKIP_TEMP", **NO_REMAT}
    # Not without that allocator (the mode needs it), never off GPU, and not where XLA_FLAGS choose a mode.
    assert step_compiler_options(0, 256, "gpu", {ALLOCATOR_ENV: "bfc"}) == NO_REMAT
    assert step_compiler_options(0, 256, "cpu", VMM) is None
    flags = {**VMM, "XLA_FLAGS": f"--{UPDATE_MODE}=ALWAYS_UPDATE"}
    assert step_compiler_options(0, 256, "gpu", flags) == NO_REMAT
    assert UPDATE_MODE not in step_compiler_options(64, 256, "gpu", flags)


NO_REMAT = {"xla_disable_hlo_passes": "rematerialization"}


class _Device:
    def __init__(self, platform: str, stats: dict[str, int] | None, driver: tuple[int, int] | None = None):
        self.platform, self._stats, self.driver = platform, stats, driver

    def memory_stats(self) -> dict[str, int] | None:
        return self._stats


def _driver(device: _Device) -> tuple[int, int] | None:
    return device.driver


def test_free_memory_counts_what_is_in_use_as_the_planner_does_at_most_what_is_free():
    gib = 2**30
    reserve = RUNTIME_RESERVE_BYTES
    assert free_device_memory([_Device("cpu", None)], _driver, 0.9, 0) is None
    # XLA's arena less the weights and the reserve, whatever the arena counts in use (leftovers of
    # the load), so that every start sizes the same pool; the arena's free bytes cap it.
    arenas = [_Device("gpu", {"bytes_limit": 60 * gib, "bytes_in_use": 16 * gib}, (70 * gib, 80 * gib)),
              _Device("gpu", {"bytes_limit": 60 * gib, "bytes_in_use": 17 * gib}, (70 * gib, 80 * gib))]
    assert free_device_memory(arenas, _driver, 0.9, 15 * gib) == 45 * gib - reserve
    arenas[1] = _Device("gpu", {"bytes_limit": 60 * gib, "bytes_in_use": 15 * gib + gib // 2}, (70 * gib, 80 * gib))
    assert free_device_memory(arenas, _driver, 0.9, 15 * gib) == 45 * gib - reserve
    full = [_Device("gpu", {"bytes_limit": 60 * gib, "bytes_in_use": 50 * gib}, (70 * gib, 80 * gib))]
    assert free_device_memory(full, _driver, 0.9, 15 * gib) == 10 * gib  # the arena's free bytes cap it
    # No statistics: the fraction XLA may take less the weights and the runtime's reserve, at most what
    # the driver says is free; what the driver says is in use (18-19 GiB here) does not count.
    vmm = [_Device("gpu", None, (63 * gib, 80 * gib)), _Device("gpu", {}, (61 * gib, 80 * gib))]
    reserve = RUNTIME_RESERVE_BYTES
    assert free_device_memory(vmm, _driver, 0.9, 15 * gib) == 72 * gib - 15 * gib - reserve
    assert free_device_memory(vmm, _driver, 1.0, 15 * gib) == 61 * gib  # the driver's free memory caps it
    assert free_device_memory(vmm, _driver, 0.2, 15 * gib) == 0  # already past the share
    with pytest.raises(ModelSpecError, match=r"^cannot size the KV pool: .* set layout\.kv_tokens$"):
        free_device_memory([_Device("gpu", None, None)], _driver, 0.9, 0)


def test_the_compiler_room_is_what_xla_assumes_usable_only_where_the_allocator_states_no_limit():
    gib = 2**30
    assert compiler_room([_Device("cpu", None)], _driver, 0) is None
    arena = _Device("gpu", {"bytes_limit": 72 * gib, "bytes_in_use": 16 * gib}, (64 * gib, 80 * gib))
    assert compiler_room([arena], _driver, 0) is None  # XLA plans with the arena's limit
    vmm = [_Device("gpu", None, (63 * gib, 80 * gib)), _Device("gpu", {}, (62 * gib, 80 * gib))]
    # 80% less the weights, the runtime's reserve and the step's margin, whatever the driver counts in use.
    want = 64 * gib - 15 * gib - RUNTIME_RESERVE_BYTES - STEP_PARAMETER_MARGIN
    assert compiler_room(vmm, _driver, 15 * gib) == want
    assert compiler_room([_Device("gpu", None, (10 * gib, 80 * gib))], _driver, 15 * gib) == want
    assert compiler_room([_Device("gpu", None, (10 * gib, 80 * gib))], _driver, 70 * gib) == 0
    assert compiler_room([_Device("gpu", None, None)], _driver, 0) is None
