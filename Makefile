# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv and install when
# needed; the stamp file makes a second run skip the install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test workers: CI machines have 2 cores.
WORKERS ?= 2

.PHONY: demo test test-fast bench docs clean

$(STAMP): requirements.txt pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -r requirements.txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/supernode preview --stack dev
	@echo; echo "== local training run of the dev plan (CPU, gloo, torchrun): steps 1-120, checkpoints every 40 =="
	rm -rf out/demo
	$(BIN)/supernode train --stack dev --local --out out/demo --steps 120
	@echo; echo "== resume: a new torchrun picks up the step-120 checkpoint and trains on to step 200 =="
	$(BIN)/supernode train --stack dev --local --out out/demo

test: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(WORKERS) -q -m "not slow"

bench: $(STAMP)
	$(BIN)/supernode bench preview

# docs/configuration.md is generated from the schema (a test fails when it is stale).
docs: $(STAMP)
	$(BIN)/supernode config reference > docs/configuration.md

clean:
	rm -rf $(VENV) .pytest_cache out
