# Thin targets, identical to what CI runs. Every target installs what it needs.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: install services demo test test-unit test-tools lint bench profile schemas clean chaos soak \
	chaos-cluster chaos-selftest chaos-tools

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

services:
	bash scripts/ensure-services.sh

demo: install services
	$(BIN)/custody demo run

# The external tools tests run (check-jsonschema, promtool in .venv-tools), so that
# `make test` passes on a fresh clone by itself; quick when already installed.
test-tools:
	bash scripts/install-test-tools.sh

# Two test processes (pytest-xdist): every test has its own databases and vhost, so
# they share nothing but the servers; the chaos tier (fixed ports) stays on one.
# TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: install services test-tools chaos-tools
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup

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

# The chaos harness starts its own Postgres clusters and RabbitMQ node(s) under .chaos/
# (never the shared ones): it needs initdb/pg_ctl and rabbitmq-server installed.
# SEED=N reproduces a run's schedule; SEEDS="1 2 3" runs several.
chaos-tools:
	@command -v initdb >/dev/null && command -v pg_ctl >/dev/null || \
	  { echo "chaos needs PostgreSQL's initdb and pg_ctl on PATH"; exit 1; }
	@test -x /usr/lib/rabbitmq/bin/rabbitmq-server || \
	  { echo "chaos needs rabbitmq-server (Debian package rabbitmq-server)"; exit 1; }

SEEDS ?= $(or $(SEED),$(shell date +%s))
chaos: install chaos-tools
	@for s in $(SEEDS); do $(BIN)/python -m chaos run --seed $$s || exit 1; done

soak: install chaos-tools
	$(BIN)/python -m chaos soak $(if $(SEED),--seed $(SEED))

chaos-cluster: install chaos-tools
	$(BIN)/python -m chaos cluster $(if $(SEED),--seed $(SEED))

# the checker's own tests: each deliberately broken build must make a run fail
chaos-selftest: install chaos-tools
	CUSTODY_CHAOS_SELFTEST=1 $(BIN)/pytest tests/chaos -m chaos_selftest

# The peers the bench runs beside custody (Celery, pgqueuer): the optional extra `bench`,
# installed once, and again after pyproject.toml changes (through $(STAMP)).
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: install $(BENCH_STAMP) services
	$(BIN)/python -m bench.run

# custody alone (no peers, no backlog), each worker sampled by py-spy during the burst
profile: install $(BENCH_STAMP) services
	$(BIN)/python -m bench.run --peers none --no-backlog --replicas 1 --profile \
		--output bench/results/profile.md

schemas: install
	$(BIN)/python scripts/gen_docs.py
	$(BIN)/custody contracts schemas

clean:
	rm -rf $(VENV) .demo .chaos .pytest_cache .mypy_cache .ruff_cache
