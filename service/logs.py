"""The serving processes' logs: what they leave out.

JAX tries every platform it knows when it starts, and logs at INFO that the TPU one failed on every
machine without a TPU ("Unable to initialize backend 'tpu': ... libtpu.so ..."): a line at every start
that reads like a fault and is none. Only that record is dropped, at its logger: a platform named in
``JAX_PLATFORMS`` that fails still raises, and another platform's failure (CUDA's on a GPU host) is
still logged.
"""

from __future__ import annotations

import logging

XLA_BRIDGE_LOGGER = "jax._src.xla_bridge"
NO_TPU = "Unable to initialize backend 'tpu'"


class _NoTpuNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and str(record.msg).startswith(NO_TPU))


def quiet_known_noise() -> None:
    """Install the filter (once; before or after JAX is imported)."""
    logger = logging.getLogger(XLA_BRIDGE_LOGGER)
    if not any(isinstance(f, _NoTpuNotice) for f in logger.filters):
        logger.addFilter(_NoTpuNotice())
