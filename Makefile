# Two commands matter: `make run` (serve the embedded default) and `make test` (the CPU suite).
# Both set up everything they need: a virtual environment with every package pinned
# (requirements/cpu.txt, installed with --no-deps so nothing unpinned sneaks in) and the tiny model.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
MODEL  := models/tiny-llama
CONFIG ?= deployments/local-cpu.yaml
PYTEST_ARGS ?=

.PHONY: install model run test test-unit test-integration bench dashboards-check clean

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

clean:
	rm -rf $(VENV) models
