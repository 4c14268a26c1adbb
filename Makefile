# The two commands a new machine needs: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast lint bootstrap vllm-trees docs clean gpu-bundle

bootstrap:
	@WCACHE_VENV=$(VENV) bash tools/bootstrap.sh

## The venv, and the other supported vLLM releases' Python trees (.vllm-trees/) that the
## per-release contract tests import (a one-time ~336 MB download; only `test` needs it).
vllm-trees:
	@WCACHE_VENV=$(VENV) bash tools/bootstrap.sh --vllm-trees

## Run the main job: build the SmolLM2 AWQ checkpoint, start the daemon, run vLLM
## from disk and from the daemon, compare the text and the weight-load times.
demo: bootstrap
	$(PY) -m wcache.demo

## Run the whole test suite (what CI runs); the contract tests also run against every
## other supported vLLM release's Python (tests/test_vllm_releases.py; a missing tree,
## which `make vllm-trees` makes, fails here instead of skipping). Two pytest-xdist
## workers, one module per worker at a time (--dist loadfile: a module's shared engines
## and daemons start once), handed out in the order tests/conftest.py sorts them, the
## slowest first (--no-loadscope-reorder: xdist would otherwise hand out the modules with
## the most tests first, and the one-test compiled-engine modules last): a vLLM-CPU
## engine start keeps about one core busy, so two run side by side on CI's 2 cores.
## TEST_WORKERS=0 runs it in one process. The 25 slowest tests' times close the report
## (where to trim when the suite nears its 30 minutes).
TEST_WORKERS ?= 2
test: vllm-trees
	WCACHE_REQUIRE_VLLM_TREES=1 $(PY) -m pytest tests -q -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

## The core, stages and plans only (seconds).
test-fast: bootstrap
	$(PY) -m pytest tests/core tests/stages tests/plans -q -p no:cacheprovider

## Lint (ruff: pyproject.toml's [tool.ruff]), formatting and types (mypy: [tool.mypy]),
## each at zero findings; CI runs it before the tests.
lint: bootstrap
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

## Regenerate docs/plans.md from the plan registry.
docs: bootstrap
	$(PY) -m wcache.cli plans --markdown > docs/plans.md

## Build the vLLM CUDA bundle the H200 harness carries over (docs/gpu.md; needs a registry).
VLLM_CUDA_VERSION ?= 0.32.0,0.33.0
gpu-bundle:
	bash tools/gpu/build-bundle.sh $(VLLM_CUDA_VERSION) .vx

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .vllm-trees
