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

.PHONY: help install demo test test-fast test-slow test-latest test-py312 lint format bench clean unsloth gpu-smoke gpu-smoke-dry gpu-wheels

help: ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

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

SLOWLOG := .test-slow.log
# The two suites each keep one core busy (the fast one is CPU-bound Python, the slow one mostly waits on
# trial processes), so on 2 cores they run side by side: the slow suite's output is printed when both end.
test: $(STAMP) lint ## lint + the test suite (the fast and the slow tests side by side)
	@$(BIN)/pytest -q -m slow > $(SLOWLOG) 2>&1 & slow=$$!; \
	$(BIN)/pytest -q; fast=$$?; \
	wait $$slow; rc=$$?; \
	echo "=== the slow suite (pytest -q -m slow, run beside the fast one; also in $(SLOWLOG)) ==="; \
	cat $(SLOWLOG); \
	echo "fast suite exit $$fast, slow suite exit $$rc"; \
	test $$fast -eq 0 && test $$rc -eq 0

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

# Python 3.12 job (torch-free): vramsweep without its dependencies plus the torch-free ones, each at its
# constraints.txt version (their own dependencies too). No torch/transformers/peft/bitsandbytes/accelerate/
# trl/wandb: PyPI's torch is a multi-GB CUDA build and the local CPU wheel is for 3.11 only. tests/conftest.py
# then runs only the tests marked `torchfree`; full torch runs on 3.12 are the GPU image's.
VENV312 := .venv-py312
TORCHFREE_DEPS := omegaconf hydra-core optuna pyyaml sqlalchemy psutil numpy tqdm pytest pytest-timeout hypothesis
test-py312: ## torch-free tests on Python 3.12 (venv .venv-py312 without torch; skipped if no 3.12 here)
	@py=$$(python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null \
	  || ls -d "$$(pyenv root 2>/dev/null || echo "$${PYENV_ROOT:-$$HOME/.pyenv}")"/versions/3.12*/bin/python3.12 \
	     2>/dev/null | sort -V | tail -1); \
	if [ -z "$$py" ]; then echo "test-py312: SKIPPED, no Python 3.12 here (python3.12, pyenv versions/3.12*)"; exit 0; fi; \
	set -ex; \
	test -x $(VENV312)/bin/python || "$$py" -m venv $(VENV312); \
	if [ ! $(VENV312)/.installed -nt constraints.txt ] || [ ! $(VENV312)/.installed -nt pyproject.toml ]; then \
	  $(VENV312)/bin/pip install -q -c constraints.txt $(TORCHFREE_DEPS); \
	  $(VENV312)/bin/pip install -q --no-deps -e .; \
	  touch $(VENV312)/.installed; \
	fi; \
	! $(VENV312)/bin/python -c 'import torch' 2>/dev/null; \
	$(VENV312)/bin/pytest -q -m 'torchfree and not slow and not gpu'

bench: $(STAMP) ## overhead, thread-count and sweep-efficiency benchmarks (prints measured ratios with spreads)
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/threads.py
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
	rm -rf $(VENV) $(LATEST) $(VENV312) .cache results wandb .pytest_cache .ruff_cache
