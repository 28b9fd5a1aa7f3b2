"""XLA flags the serving engine runs with, set before the GPU backend starts.

Command buffers (CUDA graphs) must take cuDNN's calls too: left out (XLA's default), every chunk
attention splits a step's graph, and a lone 256-token chunk step of Llama-3-8B on an H200 took
13 ms from launch to token against 9.6 ms with them in (benchmarks/NOTES.md).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

COMMAND_BUFFER_FLAG = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"


def with_serving_flags(xla_flags: str) -> str:
    """``xla_flags`` with the engine's command-buffer setting, unless it already chooses its own."""
    if "xla_gpu_enable_command_buffer" in xla_flags:
        return xla_flags
    return f"{xla_flags} {COMMAND_BUFFER_FLAG}".strip()


def apply_serving_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Put the engine's flags in XLA_FLAGS (read when JAX first touches a GPU)."""
    environ["XLA_FLAGS"] = with_serving_flags(environ.get("XLA_FLAGS", ""))
