# Thin targets, identical to what CI runs. Every target installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install services demo test test-unit test-tools lint bench schemas clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

services:
	bash scripts/ensure-services.sh

demo: install services
	$(BIN)/custody demo

# The external tools tests run (check-jsonschema, promtool in .venv-tools), so that
# `make test` passes on a fresh clone by itself; quick when already installed.
test-tools:
	bash scripts/install-test-tools.sh

test: install services test-tools
	$(BIN)/pytest

# The tier that needs no service (no Postgres, no RabbitMQ): pure code, the deploy
# files, the layers; the JSON-schema checks use check-jsonschema from .venv-tools.
test-unit: install test-tools
	$(BIN)/pytest tests/unit

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports
	$(BIN)/custody contracts schemas --check
	bash scripts/install-lint-tools.sh
	bash scripts/lint-deploy.sh

bench: install services
	$(BIN)/python -m bench.run

schemas: install
	$(BIN)/python scripts/gen_docs.py
	$(BIN)/custody contracts schemas

clean:
	rm -rf $(VENV) .demo .pytest_cache .mypy_cache .ruff_cache
