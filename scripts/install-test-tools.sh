#!/usr/bin/env bash
# Install the external tools the test suite runs, into their own venv apart from the
# project's .venv: check-jsonschema (tests/unit/test_logging.py,
# tests/acceptance/test_logs.py) and promtool (tests/acceptance/test_metrics.py), both
# at .venv-tools/bin where the tests look for them. promtool is extracted from
# Debian's `prometheus` package (no server is installed or started), or linked from
# PATH when the system has one. Then checks, without installing, the system tools
# the tests also run: openssl (test_tls), pg_dump/pg_restore (test_restore) and the
# RabbitMQ cuttlefish schemas (test_definitions). Idempotent and quiet: a second run
# only checks a stamp. `make test` runs it; scripts/install-lint-tools.sh builds on it.
#
#   bash scripts/install-test-tools.sh        # into .venv-tools (CUSTODY_TOOLS_VENV)
#   bash scripts/install-test-tools.sh --tools-only   # skip the system-tools check
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/tools-lib.sh
source scripts/tools-lib.sh

TOOLS=${CUSTODY_TOOLS_VENV:-.venv-tools}
PY=${PY:-python3}
# Pinned: bump deliberately (scripts/install-lint-tools.sh pins the lint-only tools).
PINS=(
  "check-jsonschema==0.39.0"
)
STAMP="$TOOLS/.installed-test-$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-12)"

say() { echo "install-test-tools: $*"; }

# 1. Python tools ------------------------------------------------------------------
if [ ! -f "$STAMP" ] || [ ! -x "$TOOLS/bin/check-jsonschema" ]; then
  say "creating $TOOLS with ${PINS[*]}"
  rm -f "$TOOLS"/.installed-test-*
  install_pins "$STAMP" "${PINS[@]}"
fi

# 2. promtool: only the binary, at $TOOLS/bin/promtool (where the tests run it).
if [ ! -x "$TOOLS/bin/promtool" ]; then
  if system=$(command -v promtool 2>/dev/null); then
    say "linking $system"
    ln -sf "$system" "$TOOLS/bin/promtool"
  else
    say "extracting promtool from Debian's prometheus package"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cached=$(find /var/cache/apt/archives -maxdepth 1 -name 'prometheus_*.deb' 2>/dev/null | sort | tail -n 1 || true)
    if [ -n "$cached" ]; then
      cp "$cached" "$work/"
    elif ! (cd "$work" && apt-get download prometheus >/dev/null 2>&1); then
      if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null
        (cd "$work" && apt-get download prometheus >/dev/null)
      else
        echo "install-test-tools: cannot download the prometheus package; run as root once" \
             "(apt-get update) or install it: apt-get install -y --no-install-recommends prometheus" >&2
        exit 1
      fi
    fi
    dpkg-deb -x "$work"/prometheus_*.deb "$work/root"
    install -m 0755 "$work/root/usr/bin/promtool" "$TOOLS/bin/promtool"
  fi
fi
"$TOOLS/bin/promtool" --version >/dev/null 2>&1 || {
  echo "install-test-tools: $TOOLS/bin/promtool does not run" >&2
  exit 1
}

# 3. System tools the tests run (installed with the services, not by this script).
[ "${1:-}" = "--tools-only" ] && exit 0
missing=()
for tool in openssl pg_dump pg_restore; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
compgen -G "/usr/lib/rabbitmq/lib/rabbitmq_server-*/plugins/*/priv/schema/*.schema" >/dev/null \
  || missing+=("the RabbitMQ cuttlefish schemas (/usr/lib/rabbitmq)")
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-test-tools: missing ${missing[*]}; install them with the services:" \
       "apt-get install -y openssl postgresql-client rabbitmq-server" >&2
  exit 1
fi
