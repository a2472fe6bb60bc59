# vramsweep — every target sets itself up on a fresh machine (creates .venv and installs).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export VRAMSWEEP_CACHE ?= $(CURDIR)/.cache/vramsweep
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

.PHONY: help install demo test test-fast test-slow test-latest lint format bench clean unsloth gpu-smoke gpu-smoke-dry gpu-wheels

help: ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP) ## create .venv and install vramsweep + dev tools

demo: $(STAMP) ## the main job: a real demo sweep on the embedded tiny model (CPU), then its report
	$(BIN)/vramsweep train -m sweep=demo
	$(BIN)/vramsweep report results/sweeps/demo

lint: $(STAMP) ## ruff lint + format check
	$(BIN)/ruff check src tests bench scripts setup.py
	$(BIN)/ruff format --check src tests bench scripts setup.py

format: $(STAMP) ## ruff autofix + format
	$(BIN)/ruff check --fix src tests bench scripts setup.py
	$(BIN)/ruff format src tests bench scripts setup.py

test: $(STAMP) lint ## lint + the test suite (fast tests, then slow ones)
	$(BIN)/pytest -q
	$(BIN)/pytest -q -m slow

test-fast: $(STAMP) ## the fast suite only
	$(BIN)/pytest -q

test-slow: $(STAMP) ## slow end-to-end tests only
	$(BIN)/pytest -q -m slow

LATEST := .venv-latest
# torch stays the local CPU wheel (PyPI's newest torch is a CUDA build with ~3 GB of nvidia wheels);
# LATEST_TORCH=torch takes the newest allowed one instead.
LATEST_TORCH ?= torch==2.13.0
test-latest: ## the fast suite on the newest versions pyproject allows (separate venv .venv-latest; needs PyPI)
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(LATEST)/bin/python || $(PY) -m venv $(LATEST)
	$(LATEST)/bin/pip install -q --upgrade pip
	$(LATEST)/bin/pip install -q '$(LATEST_TORCH)'
	$(LATEST)/bin/pip install -q --upgrade --upgrade-strategy eager -e '.[dev]' '$(LATEST_TORCH)'
	$(LATEST)/bin/pip freeze --exclude-editable > $(LATEST)/freeze.txt
	@diff constraints.txt $(LATEST)/freeze.txt | grep '^[<>]' || true
	$(LATEST)/bin/pytest -q


bench: $(STAMP) ## overhead + sweep-efficiency benchmarks (prints measured ratios)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/sweep_efficiency.py

unsloth: $(STAMP) ## optional: unsloth 2026.10.9 without its CUDA-pulling pins (imports and trains on CPU too)
	$(BIN)/pip install -q --no-deps unsloth==2026.10.9 unsloth_zoo==2026.10.9

gpu-smoke: ## on a CUDA machine (its own torch; wheels/gpu_bundle.tar.xz if present): the one-shot GPU smoke (<= 8 min)
	bash scripts/gpu_smoke.sh

gpu-smoke-dry: $(STAMP) ## the GPU smoke path on CPU with the embedded tiny model (what CI checks)
	bash scripts/gpu_smoke.sh --dry-run

gpu-wheels: $(STAMP) ## where PyPI is reachable: wheels/gpu_bundle.tar.xz (<= 64 MiB) with all the offline GPU image lacks
	bash scripts/fetch_gpu_wheels.sh

clean: ## remove the venv, caches and results
	rm -rf $(VENV) $(LATEST) .venv-py312 .cache results wandb .pytest_cache .ruff_cache
