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

# vLLM in a virtualenv of its own, for the conformance harness (lab/conformance.py,
# tests/conformance/): its pins and its torch never meet kvmesh's .venv.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	$(PY) -m venv .venv-vllm && .venv-vllm/bin/pip install --no-deps torch==2.13.0 && .venv-vllm/bin/pip install --no-deps vllm==0.33.0 aiohappyeyeballs aiohttp aiosignal annotated-doc annotated-types anyio apache-tvm-ffi attrs cachetools cbor2 certifi cloudpickle fastapi filelock frozenlist h11 httpcore2 httpx2 huggingface_hub idna importlib_metadata llguidance mpmath msgspec multidict networkx numpy openai openai-harmony opentelemetry-api packaging partial-json-parser pillow prometheus_client propcache psutil py-cpuinfo pybase64 pydantic pydantic_core PyYAML pyzmq regex requests safetensors sniffio starlette sympy tokenizers tqdm transformers truststore typing_extensions typing-inspection urllib3 uvloop xgrammar yarl zipp
	touch $(VLLM_STAMP)

node_modules/.bin/buf: package.json
	npm ci --no-audit --no-fund --loglevel=error
	touch node_modules/.bin/buf

clients/node/node_modules/.installed: clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

setup: $(STAMP) $(VLLM_STAMP) node_modules/.bin/buf clients/node/node_modules/.installed

## The main job: the whole cluster on this machine, driven by the Mooncake trace.
run: $(STAMP)
	$(BIN)/kvmesh up

## The whole test suite (what CI runs).
test: $(STAMP) $(VLLM_STAMP)
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
	rm -rf $(VENV) $(VLLM_VENV) node_modules build *.egg-info
