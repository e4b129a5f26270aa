# fair_frontend: every target does its own set-up, so on a fresh machine
#   make run    starts the service (embedded Triton + the example config)
#   make test   lints (make lint), then runs the whole suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PERF_ANALYZER := $(BIN)/perf_analyzer
# AIPerf (NVIDIA's load generator for OpenAI-compatible servers), in a virtual environment
# of its own: it pins versions of prometheus-client and others that differ from ours.
AIPERF_VENV := .venv-aiperf
AIPERF := $(AIPERF_VENV)/bin/aiperf
AIPERF_VERSION := 0.13.0
PA_VERSION := 2.46.0
CONFIG ?= examples/config.yaml
PYTEST_ARGS ?=
# Test processes (pytest-xdist), each with its own session Triton, each file run whole by
# one of them (its module fixtures started once); 0: one process, no workers.
TEST_WORKERS ?= 2
# What make lint checks: ruff (lint and format) and mypy, one configuration for all
# (pyproject.toml).
LINT_PATHS := fair_frontend python_backend tests benchmarks
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup system-deps run test lint bench clean images push

setup: system-deps $(STAMP) $(PERF_ANALYZER) $(AIPERF)

# Debian packages: redis-server (tests start their own), libb64-0d (perf_analyzer),
# openssl (the fleet's TLS tests make their certificates with it), kubectl (the k8s
# manifests' tests render them with `kubectl kustomize`; Debian's package for it is
# kubernetes-client). The tests that need one fail, not skip, where it is missing.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	command -v kubectl >/dev/null || missing="$$missing kubernetes-client"; \
	dpkg -s libb64-0d >/dev/null 2>&1 || missing="$$missing libb64-0d"; \
	if [ -n "$$missing" ]; then \
	  echo "==> installing Debian packages:$$missing"; \
	  $(SUDO) apt-get update -q && $(SUDO) DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi

$(STAMP): pyproject.toml
	@echo "==> virtual environment in $(VENV)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --progress-bar off -e '.[dev]'
	@touch $@

# perf_analyzer: the binary in the tritonclient 2.46 wheel is the newest that runs on
# glibc 2.36 (see README). Unpacked into the venv, wrapped to find libcudart.
$(PERF_ANALYZER): $(STAMP)
	@echo "==> perf_analyzer $(PA_VERSION)"
	@tmp=$$(mktemp -d) && \
	$(BIN)/python -m pip download -q --no-deps -d $$tmp tritonclient==$(PA_VERSION) && \
	mkdir -p $(VENV)/opt/perf_analyzer && \
	$(BIN)/python -c "import zipfile,sys; z=zipfile.ZipFile(sys.argv[1]); open(sys.argv[2],'wb').write(z.read('tritonclient-$(PA_VERSION).data/data/bin/perf_analyzer'))" \
	  $$tmp/tritonclient-$(PA_VERSION)-*.whl $(VENV)/opt/perf_analyzer/perf_analyzer && \
	chmod +x $(VENV)/opt/perf_analyzer/perf_analyzer && rm -rf $$tmp
	@printf '%s\n' '#!/usr/bin/env bash' \
	  'here="$$(cd "$$(dirname "$${BASH_SOURCE[0]}")/.." && pwd)"' \
	  'cudart="$$("$$here/bin/python" -c "import nvidia.cuda_runtime, os; print(os.path.join(list(nvidia.cuda_runtime.__path__)[0], \"lib\"))")"' \
	  'export LD_LIBRARY_PATH="$$cudart$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH}"' \
	  'exec "$$here/opt/perf_analyzer/perf_analyzer" "$$@"' > $@
	@chmod +x $@

$(AIPERF):
	@echo "==> aiperf $(AIPERF_VERSION) in $(AIPERF_VENV)"
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --progress-bar off aiperf==$(AIPERF_VERSION)

run: setup
	$(BIN)/fair-frontend up --config $(CONFIG)

# The lint first: CI runs only `make test` (.ci/run), and a lint error fails it in under a
# minute instead of after the suite.
test: setup lint
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy $(LINT_PATHS)

# The two images the chart and compose run (docker/README.md, "Images"), built from this
# tree: $(IMAGE_REPOSITORY):serve (docker/Dockerfile.serve: the core and the shells) and
# $(IMAGE_REPOSITORY):triton (docker/Dockerfile: Triton with the models), each also tagged
# with the version (serve-0.2.0, triton-0.2.0) for a pinned deployment. `make push` pushes
# all four tags; then install the chart with
#   --set image.repository=$(IMAGE_REPOSITORY) --set triton.image.repository=$(IMAGE_REPOSITORY)
# (tests/test_helm_chart.py renders that and checks the pods' images are these).
IMAGE_REPOSITORY ?= fair-frontend
DOCKER ?= docker
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)

images:
	$(DOCKER) build -f docker/Dockerfile.serve -t $(IMAGE_REPOSITORY):serve -t $(IMAGE_REPOSITORY):serve-$(VERSION) .
	$(DOCKER) build -f docker/Dockerfile -t $(IMAGE_REPOSITORY):triton -t $(IMAGE_REPOSITORY):triton-$(VERSION) .

push: images
	$(DOCKER) push $(IMAGE_REPOSITORY):serve
	$(DOCKER) push $(IMAGE_REPOSITORY):serve-$(VERSION)
	$(DOCKER) push $(IMAGE_REPOSITORY):triton
	$(DOCKER) push $(IMAGE_REPOSITORY):triton-$(VERSION)

bench: setup
	$(BIN)/python -m benchmarks.run_all

clean:
	rm -rf $(VENV) $(AIPERF_VENV) .pytest_cache .mypy_cache .ruff_cache
