#!/usr/bin/env bash
# Lint, type-check the contract, check the layers, then the whole suite (the examples included:
# tests/examples runs each as a user would). Exit non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# Bytecode is written during the run, whatever the environment says: where
# PYTHONDONTWRITEBYTECODE is set (the CI image sets it), each of the few hundred processes the
# suite starts compiled the kvxfer modules it imports again (about 0.3 s of CPU each), and each
# pytest worker rewrote the assertions of every test module again (about 11 s of CPU each).
unset PYTHONDONTWRITEBYTECODE
# Made once, beside the lint steps (one core each): kvxfer's bytecode, and pytest's rewritten
# test modules (a collection), which the workers then read instead of making their own.
{ "$VENV/bin/python" -m compileall -q kvxfer >/dev/null
  "$VENV/bin/python" -m pytest --collect-only -q -p no:cacheprovider "$@" >/dev/null 2>&1; } &
warm=$!
trap 'kill "$warm" 2>/dev/null || true' EXIT  # a failing lint step ends the script: the warm-up too
"$VENV/bin/ruff" check --no-cache kvxfer tests examples bench  # no cache: a warm one hid a CI failure
"$VENV/bin/mypy" --strict kvxfer/contract
"$VENV/bin/lint-imports"  # the layers: pyproject.toml [tool.importlinter]
wait "$warm" || true  # a collection that fails is reported by the run itself
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
