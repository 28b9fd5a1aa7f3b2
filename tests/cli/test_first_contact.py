"""What a new user meets first, beyond the README's commands (test_readme_commands.py) and mistakes
(test_cli_mistakes.py): help that shows defaults, and a log without JAX's notice of a missing TPU."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from switchyard.service.logs import XLA_BRIDGE_LOGGER, quiet_known_noise

pytestmark = pytest.mark.timeout(120)


def test_serve_help_shows_the_defaults() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    done = subprocess.run([sys.executable, "-m", "switchyard.cli.main", "serve", "--help"], capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps lines
    for default in ("(default: 8001)", "(default: [::])", "(default: 1)", "(default: auto)", "(default: INFO)"):
        assert default in text, (default, text)
    assert "(default: None)" not in text and "(default: False)" not in text, text


def test_only_the_missing_tpu_notice_is_dropped(caplog: pytest.LogCaptureFixture) -> None:
    quiet_known_noise()
    quiet_known_noise()  # once is enough; twice changes nothing
    log = logging.getLogger(XLA_BRIDGE_LOGGER)
    assert len(log.filters) == 1
    with caplog.at_level(logging.INFO, logger=XLA_BRIDGE_LOGGER):
        log.info("Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so")
        log.info("Unable to initialize backend 'cuda': no supported devices found")
        log.warning("An NVIDIA GPU may be present on this machine, but a CUDA-enabled jaxlib is not installed.")
    assert [r.getMessage().partition(":")[0][:32] for r in caplog.records] == [
        "Unable to initialize backend 'cu", "An NVIDIA GPU may be present on "]
