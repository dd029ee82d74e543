#!/usr/bin/env bash
# Lint, type-check the contract, run the tests. Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check kvxfer tests examples
"$VENV/bin/mypy" --strict kvxfer/contract
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
# The examples are part of the contract with users: they must run as documented.
for example in examples/loopback_roundtrip.py examples/pair_local.py examples/router_embed.py; do
  echo "== $example"
  "$VENV/bin/python" "$example" >/tmp/kvxfer-example.log 2>&1 || { cat /tmp/kvxfer-example.log; exit 1; }
  tail -3 /tmp/kvxfer-example.log
done
