# Two entry points for a newcomer: `make demo` (run it) and `make test` (test it).
# Each creates the virtual environment and installs what it needs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint venv

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m switchyard.kernels.build --optional
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/switchyard demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
