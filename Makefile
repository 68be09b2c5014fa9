# fedskew: `make run` sets up and runs the default job (FedAvg and FedRS side by side); `make test` sets up and tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
FMNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
export FLWR_TELEMETRY_ENABLED=0
export FLWR_DISABLE_UPDATE_CHECK=1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1

.PHONY: venv data deploy-tools run test lint clean demo

venv: $(VENV)/.installed

# torch 2.13.0 first (the local CPU wheel here), so nothing pulls a CUDA build; then the app.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	touch $@

# Fashion-MNIST from Debian (offline); elsewhere `fedskew data get fashion-mnist` downloads it to ./data.
data:
	@if [ -f $(FMNIST) ] || ls data/fashion-mnist/train-images-idx3-ubyte* >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's dataset-fashion-mnist"; \
		(apt-get install -y -qq dataset-fashion-mnist || (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist)) >/dev/null; \
	else echo "Fashion-MNIST missing: apt-get install dataset-fashion-mnist (as root), or $(VENV)/bin/fedskew data get fashion-mnist"; exit 1; fi

# nginx: the SuperLink's gateway in deployments (deploy/gateway.sh), which the multi-host test starts.
deploy-tools:
	@if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian's nginx-light (the deployment gateway)"; \
		(apt-get install -y -qq nginx-light || (apt-get update -qq && apt-get install -y -qq nginx-light)) >/dev/null; \
	else echo "nginx missing (apt-get install nginx-light): the multi-host deployment test will be skipped"; fi

# The default job (suites/demo.yaml): FedAvg and FedRS on the same split, one comparison table;
# ARGS="..." runs `fedskew run ARGS` instead.
ifdef ARGS
RUN = $(VENV)/bin/fedskew run $(ARGS)
else
RUN = $(VENV)/bin/fedskew experiment suites/demo.yaml
endif

run: venv data
	$(RUN)

# A pytest-xdist worker a core (tests that share the machine's network namespaces run on one worker).
test: venv data deploy-tools
	$(PY) -m pytest -q -n $$(nproc) --dist loadgroup $(PYTEST_ARGS)

# The Docker demo (docs/deployment.md, "Docker demo"): DEMO_ARGS=--offline builds without a registry.
demo: venv data
	docker/demo.sh $(DEMO_ARGS)

lint: venv
	$(VENV)/bin/ruff check fedskew tests benchmarks

clean:
	rm -rf $(VENV) .flwr-home .pytest_cache
