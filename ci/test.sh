#!/usr/bin/env bash
# Lint, type-check the contract, run the tests. Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check kvxfer tests examples
"$VENV/bin/mypy" --strict kvxfer/contract
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
