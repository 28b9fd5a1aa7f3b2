"""Shared test helpers: fixtures, reference models, harnesses and the scripts tests run in subprocesses."""

from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]  # the repository
