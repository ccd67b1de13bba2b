# kvmesh developer commands. `make run` and `make test` are the README's two
# commands: each sets up .venv (and node_modules for buf) on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test check lint fmt gen gen-check bench setup clean peer-venvs

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,helm,local]'
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

# NVIDIA Dynamo's standalone KV indexer, the peer of `kvmesh bench peer`, in a
# virtualenv of its own (its pydantic pin is not kvmesh's); the bench installs it
# the same way on first use. The .gitignore inside keeps it out of git.
DYNAMO_VENV := .venv-dynamo
DYNAMO_STAMP := $(DYNAMO_VENV)/.installed

$(DYNAMO_STAMP):
	$(PY) -m venv $(DYNAMO_VENV) && echo '*' > $(DYNAMO_VENV)/.gitignore && $(DYNAMO_VENV)/bin/pip install --quiet ai-dynamo-runtime==1.6.1
	touch $(DYNAMO_STAMP)

## The virtualenvs of `kvmesh bench peer`: vLLM (the publishers) and Dynamo (the peer).
peer-venvs: $(VLLM_STAMP) $(DYNAMO_STAMP)

# SGLang in a virtualenv of its own, for the conformance harness against its radix cache
# (lab/conformance_sglang.py, tests/conformance/test_sglang.py). The warm-up compiles SGLang's
# C++ hash extension into the virtualenv and builds every scenario's tree once.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP):
	$(PY) -m venv .venv-sglang && .venv-sglang/bin/pip install --no-deps sglang==0.5.23 torch==2.13.0 transformers==5.19.0 tokenizers==0.23.2 safetensors torchvision==0.28.0 apache-tvm-ffi==0.1.11 openai==2.8.0 numpy orjson psutil pybase64 requests urllib3 idna certifi typing-extensions triton packaging pillow starlette anyio msgspec pydantic-core pyzmq tqdm IPython traitlets pygments pydantic typing-inspection aiohttp multidict attrs yarl propcache aiohappyeyeballs aiosignal frozenlist annotated-types sympy mpmath regex huggingface-hub httpx2 pyyaml filelock httpcore2 truststore h11 dill sentencepiece networkx compressed-tensors loguru gguf httpx sniffio distro partial-json-parser
	PYTHONPATH=. .venv-sglang/bin/python -m lab.engines.sglang_engine --warm-up
	touch $(SGLANG_STAMP)

node_modules/.bin/buf: package.json
	npm ci --no-audit --no-fund --loglevel=error
	touch node_modules/.bin/buf

# npm ci runs the package's `prepare` script: tsc builds clients/node/dist/.
clients/node/node_modules/.installed: clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

setup: $(STAMP) $(VLLM_STAMP) $(DYNAMO_STAMP) $(SGLANG_STAMP) node_modules/.bin/buf clients/node/node_modules/.installed

## The main job: the whole cluster on this machine, driven by the Mooncake trace.
run: $(STAMP)
	$(BIN)/kvmesh up

## The whole test suite (what CI runs), two files at a time (pytest-xdist): most
## of a test's time is waiting (leases, timeouts, child processes, round trips),
## so two workers on two cores take about half the time of one. A file runs
## whole on one worker, so its module fixtures (the conformance engines) start
## once. TEST_JOBS=0 runs it in this process.
TEST_JOBS ?= 2
test: $(STAMP) $(VLLM_STAMP) $(DYNAMO_STAMP) $(SGLANG_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile

## Lint + format check + type check + buf lint + buf breaking + stub freshness.
check: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	cd proto && ../node_modules/.bin/buf lint
	tools/buf_breaking.sh
	$(BIN)/python tools/gen_protos.py --check
	cd clients/node && node tools/gen-stubs.js --check

fmt: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

gen: $(STAMP)
	$(BIN)/python tools/gen_protos.py

## Stubs of the API for other languages, not committed (docs/api.md, "Stubs for other
## languages"): Python and TypeScript, and Go when protoc-gen-go and protoc-gen-go-grpc
## are on PATH, into $(STUBS_OUT) (relative to proto/). Also the Node.js client's
## committed TypeScript stubs, clients/node/src/gen/.
STUBS_OUT ?= ../gen
.PHONY: stubs
stubs: $(STAMP) node_modules/.bin/buf
	cd proto && ../node_modules/.bin/buf generate --template buf.gen.yaml -o $(STUBS_OUT)
	cd proto && ../node_modules/.bin/buf generate --template buf.gen.node.yaml -o ../clients/node
	@if command -v protoc-gen-go >/dev/null && command -v protoc-gen-go-grpc >/dev/null; then \
		echo "cd proto && ../node_modules/.bin/buf generate --template buf.gen.go.yaml -o $(STUBS_OUT)"; \
		cd proto && ../node_modules/.bin/buf generate --template buf.gen.go.yaml -o $(STUBS_OUT); \
	else \
		echo "stubs: protoc-gen-go or protoc-gen-go-grpc not on PATH: Go stubs skipped"; \
	fi

bench: $(STAMP)
	$(BIN)/kvmesh bench indexer

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DYNAMO_VENV) $(SGLANG_VENV) node_modules build *.egg-info
