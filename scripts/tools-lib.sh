# Shared by scripts/install-test-tools.sh and scripts/install-lint-tools.sh (sourced).
#
#   install_pins STAMP PIN...   pip-install the pinned tools into $TOOLS (a venv made
#                               with $PY if missing), quietly, then touch STAMP; the
#                               install log is shown only if pip fails.
install_pins() {
  local stamp=$1
  shift
  [ -x "$TOOLS/bin/python" ] || "$PY" -m venv "$TOOLS"
  local log
  log=$(mktemp)
  if ! "$TOOLS/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    exit 1
  fi
  rm -f "$log"
  touch "$stamp"
}
