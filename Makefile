# Two commands matter: `make run` (serve the embedded default) and `make test` (the CPU suite).
# Both set up everything they need: a virtual environment with every package pinned
# (requirements/cpu.txt, installed with --no-deps so nothing unpinned sneaks in) and the tiny model.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := models/tiny-llama
CONFIG ?= deployments/local-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install model run test test-unit test-integration bench bench-agreement clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip==24.3.1
	$(BIN)/python -m pip install -q --no-deps -r requirements/cpu.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

model: $(MODEL)/.serve_app_model.json

$(MODEL)/.serve_app_model.json: | install
	$(BIN)/serve-app make-model tiny --out $(MODEL)

run: install model
	$(BIN)/serve-app run --config $(CONFIG)

test: install model
	$(BIN)/python -m pytest -v -rs tests $(PYTEST_ARGS)

test-unit: install
	$(BIN)/python -m pytest -v tests/unit $(PYTEST_ARGS)

test-integration: install model
	$(BIN)/python -m pytest -v -rs tests/integration $(PYTEST_ARGS)

# The benchmark against the embedded default: starts the stack, drives it, leaves
# bench/out/local/{results.json,summary.md,*.png}, stops the stack.
BENCH_ARGS ?= --concurrency 1,4,16 --num-requests 16,64,128 --input-len 128 --output-len 64 \
	--static-vs-continuous 16 --batching-output-len 16-384 \
	--tenant team-a::2 --tenant team-b::1 --slo-ttft-ms 500 --slo-tpot-ms 50
bench: install model
	bash bench/with_local_stack.sh $(BIN)/serve-app bench $(BENCH_ARGS) \
		--label "embedded default (tiny-llama, CPU)" --out bench/out/local

# `serve-app bench` and `vllm bench serve` on the same endpoint and load.
bench-agreement: install model
	bash bench/with_local_stack.sh bash bench/agreement.sh

clean:
	rm -rf $(VENV) models
