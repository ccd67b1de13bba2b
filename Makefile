# kvmesh developer commands. `make run` and `make test` are the README's two
# commands: each sets up .venv (and node_modules for buf) on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check lint fmt gen gen-check bench setup clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,helm,local]'
	# NIXL (DRAM<->DRAM over UCX on CPU hosts) without its torch dependency.
	$(BIN)/pip install --quiet --no-deps nixl-cu12==1.5.1
	touch $(STAMP)

node_modules/.bin/buf: package.json
	npm ci --no-audit --no-fund --loglevel=error
	touch node_modules/.bin/buf

clients/node/node_modules/.installed: clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

setup: $(STAMP) node_modules/.bin/buf clients/node/node_modules/.installed

## The main job: the whole cluster on this machine, driven by the Mooncake trace.
run: $(STAMP)
	$(BIN)/kvmesh up

## The whole test suite (what CI runs).
test: $(STAMP)
	$(BIN)/python -m pytest -q

## Lint + format check + type check + buf lint + buf breaking + stub freshness.
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	cd proto && ../node_modules/.bin/buf lint
	tools/buf_breaking.sh
	$(BIN)/python tools/gen_protos.py --check

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

gen: $(STAMP)
	$(BIN)/python tools/gen_protos.py

bench: $(STAMP)
	$(BIN)/kvmesh bench indexer

clean:
	rm -rf $(VENV) node_modules build *.egg-info
