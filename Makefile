# make demo / make test: set up .venv (torch==2.13.0 CPU, test deps, fxrt with its C++ extension),
# then run the demo or the test suite. Both are idempotent: nothing is reinstalled unless an input
# of that step changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH_VERSION := 2.13.0
EXT_SOURCES := $(wildcard fxrt/_speedups/*.pyx fxrt/_speedups/*.h fxrt/_speedups/*.pxd)

.PHONY: demo test sweep bench lint format clean

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install "setuptools>=64" wheel "cython>=3.0" pytest hypothesis expecttest ruff numpy matplotlib transformers==5.24.0
	touch $@

$(VENV)/.fxrt: $(VENV)/.deps setup.py pyproject.toml $(EXT_SOURCES)
	$(PIP) install --no-build-isolation -e .
	touch $@

demo: $(VENV)/.fxrt
	$(PY) -m fxrt demo

lint: $(VENV)/.deps
	$(VENV)/bin/ruff check fxrt tests benchmarks examples
	$(VENV)/bin/ruff format --check fxrt tests benchmarks examples

format: $(VENV)/.deps
	$(VENV)/bin/ruff format fxrt tests benchmarks examples
	$(VENV)/bin/ruff check --fix fxrt tests benchmarks examples

test: $(VENV)/.fxrt lint
	$(PY) -m pytest -q -x -p no:cacheprovider tests

# The full OpInfo sweep over both loops (slow): see README.
sweep: $(VENV)/.fxrt
	FXRT_SWEEP=full $(PY) -m pytest -q -p no:cacheprovider tests/test_opinfo.py

# Every number the README quotes (several minutes; run on a quiet machine).
bench: $(VENV)/.fxrt
	$(PY) -m fxrt bench --rounds 25
	$(PY) benchmarks/entry.py
	$(PY) benchmarks/dynamic.py
	$(PY) benchmarks/cache.py
	$(PY) benchmarks/compile_time.py --sizes 1000 3000 6000 15000
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/inductor.py

clean:
	rm -rf build dist *.egg-info fxrt/_speedups/*.so fxrt/_speedups/*.cpp
