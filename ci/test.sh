#!/usr/bin/env bash
# Lint, type-check the contract, run the examples, run the tests. Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check --no-cache kvxfer tests examples bench  # no cache: a warm one hid a CI failure
"$VENV/bin/mypy" --strict kvxfer/contract
"$VENV/bin/lint-imports"  # the layers: pyproject.toml [tool.importlinter]
# The examples are part of the contract with users: they must run as documented.
log=$(mktemp)
for example in examples/loopback_roundtrip.py examples/lender_tour.py examples/pair_local.py examples/router_embed.py examples/microbench.py examples/two_process_nixl.py examples/engine_kv_tour.py; do
  echo "== $example"
  "$VENV/bin/python" "$example" >"$log" 2>&1 || { cat "$log"; rm -f "$log"; exit 1; }
  tail -3 "$log"
done
rm -f "$log"
# pytest runs last so that its summary is the run's closing line.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
