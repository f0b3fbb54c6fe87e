#!/usr/bin/env bash
# The Python package's suite (python/tests) in one virtual environment,
# created once and reused: $FLASHATTN_VENV, or .venv at the repository's
# root. `setup` installs torch, transformers, numpy, pytest, maturin and
# ring-flash-attn (without its dependencies) from PyPI when the
# environment lacks them (torch pulls its CUDA wheels, several GB, once)
# and the package itself with `pip install ./python`;
# `run` runs pytest on the CPU backend and wgpu (required: a missing
# adapter fails the run); `run ARGS` runs pytest with ARGS only. Without an argument, both.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${FLASHATTN_VENV:-$PWD/.venv}
py=$venv/bin/python

# Debian's python3 makes virtual environments only with python3-venv.
make_venv() {
  if python3 -m venv "$venv" 2>/dev/null; then return 0; fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test-python.sh: cannot create $venv; install python3-venv (as root: apt-get install python3-venv)" >&2
    exit 1
  fi
  rm -rf "$venv"
  echo "scripts/test-python.sh: installing python3-venv"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv >/dev/null
  python3 -m venv "$venv"
}

setup() {
  if [ ! -x "$py" ]; then
    make_venv
  fi
  if ! "$py" -c "import torch, transformers, numpy, pytest, maturin" 2>/dev/null; then
    echo "scripts/test-python.sh: installing torch, transformers, numpy, pytest, maturin into $venv"
    "$py" -m pip install -q --upgrade pip
    "$py" -m pip install -q torch transformers numpy pytest maturin
  fi
  # ring-flash-attn's ring code, run on the engine by the distributed tests
  # (pure Python; without its flash-attn dependency, which needs CUDA: the
  # engine serves flash-attn's interface).
  if ! "$py" -c "import importlib.util as u; assert u.find_spec('ring_flash_attn')" 2>/dev/null; then
    "$py" -m pip install -q --no-deps "ring-flash-attn==0.1.8"
  fi
  # The user's command, `pip install ./python` (maturin, release), with two
  # changes that let it reuse what `cargo test --release` already compiled
  # in the same target directory: the package's `test-build` feature (the
  # library's test hooks and naga's features, as the test build unifies
  # them; without it wgpu and the library compile a second time), and
  # maturin from this environment instead of a fresh isolated one.
  # FLASHATTN_PYTHON_AS_USERS=1 builds exactly what a user gets.
  if [ "${FLASHATTN_PYTHON_AS_USERS:-0}" = 1 ]; then
    "$py" -m pip install -q ./python
  else
    # (The build backend runs `maturin` from PATH.)
    PATH="$venv/bin:$PATH" MATURIN_PEP517_ARGS="--features test-build" \
      "$py" -m pip install -q --no-build-isolation ./python
  fi
}

run() {
  export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" GALLIVM_PERF="${GALLIVM_PERF-nopt}"
  # From outside the repository: the installed package, not python/flashattn.
  cd python/tests
  if [ $# -gt 0 ]; then
    "$py" -m pytest -q -p no:cacheprovider "$@"
    return
  fi
  # The functions' tests run on both backends (their fixture); the
  # Transformers models, which call the same functions, on the CPU backend
  # ($FLASHATTN_BACKEND=wgpu runs them on wgpu).
  "$py" -m pytest -q -p no:cacheprovider
}

case "${1:-all}" in
  setup) setup ;;
  run) shift; run "$@" ;;
  all) setup; run ;;
  *) echo "usage: scripts/test-python.sh [setup|run [pytest args]|all]" >&2; exit 2 ;;
esac
