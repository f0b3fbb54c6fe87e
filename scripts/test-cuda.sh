#!/usr/bin/env bash
# The CUDA backend's checks that need no GPU (feature cuda): NVRTC and
# ptxas from PyPI (nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12, installed
# into $FLASHATTN_CUDA_VENV, default .cuda-venv, unless that venv already has
# them), then tests/cuda.rs with NVRTC required: every kernel variant to
# PTX for sm_80 and, where the code differs, sm_90a (some Hopper variants
# also as the GPU checks build them, their waits bounded), no spills in the
# main variants (the Hopper forward's SASS checked when nvdisasm installs),
# the kernels under host emulation (g++, installed when missing: with
# FLASHATTN_REQUIRE_NVRTC=1 a missing compiler fails), the no-driver error;
# and the command line's no-driver test. The tests that need a device are
# waived here, each listed as `WAIVED <test>: no driver: ...` at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v g++ >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test-cuda.sh: g++ is missing (the host emulation needs it); run as root to install it" >&2
    exit 1
  fi
  echo "scripts/test-cuda.sh: installing g++"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null
fi

venv=${FLASHATTN_CUDA_VENV:-.cuda-venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ ! -e "$site/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] || [ ! -x "$site/nvidia/cuda_nvcc/bin/ptxas" ]; then
  "$venv/bin/pip" install -q nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
fi
# nvdisasm (PyPI nvidia-cuda-nvdisasm, 6 MB) shows the Hopper forward's
# SASS: HGMMA, UTMALDG, USETMAXREG. Optional: installed into the default venv
# only (a venv named by FLASHATTN_CUDA_VENV is used as it is), skipped where
# pip cannot get it.
nvdisasm=$(find "$site/nvidia" -name nvdisasm -type f 2>/dev/null | head -n 1 || true)
if [ -z "$nvdisasm" ] && [ -z "${FLASHATTN_CUDA_VENV:-}" ] && "$venv/bin/pip" install -q nvidia-cuda-nvdisasm 2>/dev/null; then
  nvdisasm=$(find "$site/nvidia" -name nvdisasm -type f | head -n 1)
fi
if [ -n "$nvdisasm" ]; then export FLASHATTN_NVDISASM="$nvdisasm"; fi
export LD_LIBRARY_PATH="$site/nvidia/cuda_nvrtc/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export FLASHATTN_PTXAS="$site/nvidia/cuda_nvcc/bin/ptxas" FLASHATTN_REQUIRE_NVRTC=1 FLASHATTN_CXX=g++
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
waivers=$(mktemp)
export FLASHATTN_WAIVERS=$waivers

# Both with the workspace's feature set, so the release build of
# scripts/test.sh is reused (with -p alone, wgpu was built twice more).
# The GPU checks' emulated smoke cases and deadlock run in their dry mode
# (scripts/gpu-check.sh dry, next in CI), on the binary they ship. Cargo's
# arguments and the harness's (after --) go to their places.
cargo_args=() test_args=() after=0
for a in "$@"; do
  if [ "$after" = 1 ]; then test_args+=("$a"); elif [ "$a" = -- ]; then after=1; else cargo_args+=("$a"); fi
done
cargo test --release --workspace --features flashattn-cli/cuda --lib --test cuda "${cargo_args[@]}" -- \
  --skip the_hopper_smoke_cases_pass_under_host_emulation --skip a_deadlocked_mbarrier_wait "${test_args[@]}"
cargo test --release --workspace --features flashattn-cli/cuda --test cli cuda "$@"
if [ -s "$waivers" ]; then
  echo "scripts/test-cuda.sh: waived (they need what this machine lacks):"
  sort "$waivers"
fi
rm -f "$waivers"
