#!/usr/bin/env bash
# Lint, type-check the contract, check the layers, then the whole suite (the examples included:
# tests/examples runs each as a user would). Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
"$VENV/bin/ruff" check --no-cache kvxfer tests examples bench  # no cache: a warm one hid a CI failure
"$VENV/bin/mypy" --strict kvxfer/contract
"$VENV/bin/lint-imports"  # the layers: pyproject.toml [tool.importlinter]
# kvxfer's bytecode, compiled once here: where PYTHONDONTWRITEBYTECODE is set (as on the CI
# image) no import writes it, and each of the few hundred processes the suite starts would
# compile the modules it imports again (about 0.3 s of CPU each).
"$VENV/bin/python" -m compileall -q kvxfer >/dev/null
# Tests in parallel (pytest-xdist): most of the suite waits on processes, sockets and deadlines
# rather than the CPU, so more workers than cores pay. One file per worker at a time
# (--dist loadfile), so that a module's fixtures (worker pairs, a Mooncake master, etcd) are
# started once. KVXFER_TEST_WORKERS=0 runs in this process, one test at a time.
WORKERS=${KVXFER_TEST_WORKERS:-4}
parallel=()
[ "$WORKERS" != 0 ] && parallel=(-n "$WORKERS" --dist loadfile)
# pytest runs last so that its summary (with the slowest tests and the time per directory,
# tests/conftest.py) is the run's closing lines.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider "${parallel[@]}" "$@"
