# make demo / make test: set up .venv (torch==2.13.0 CPU, test deps, fxrt with its C++ extension),
# then run the demo or the test suite. Both are idempotent: nothing is reinstalled unless an input
# of that step changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH_VERSION := 2.13.0
EXT_SOURCES := $(wildcard fxrt/_speedups/*.pyx fxrt/_speedups/*.h fxrt/_speedups/*.pxd)

.PHONY: demo test test-fast sweep bench lint format clean

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install "setuptools>=64" wheel "cython>=3.0" pytest hypothesis expecttest ruff numpy matplotlib
	touch $@

$(VENV)/.fxrt: $(VENV)/.deps setup.py pyproject.toml $(EXT_SOURCES)
	$(PIP) install --no-build-isolation -e .
	touch $@

demo: $(VENV)/.fxrt
	$(PY) -m fxrt demo

lint: $(VENV)/.deps
	$(VENV)/bin/ruff check fxrt tests benchmarks
	$(VENV)/bin/ruff format --check fxrt tests benchmarks

format: $(VENV)/.deps
	$(VENV)/bin/ruff format fxrt tests benchmarks
	$(VENV)/bin/ruff check --fix fxrt tests benchmarks

test: $(VENV)/.fxrt lint
	$(PY) -m pytest -q -x -p no:cacheprovider tests

# The full OpInfo sweep over both loops (slow): see README.
sweep: $(VENV)/.fxrt
	FXRT_SWEEP=full $(PY) -m pytest -q -p no:cacheprovider tests/test_opinfo.py

bench: $(VENV)/.fxrt
	$(PY) benchmarks/overhead.py

clean:
	rm -rf build dist *.egg-info fxrt/_speedups/*.so fxrt/_speedups/*.cpp
