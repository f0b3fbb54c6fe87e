#!/usr/bin/env bash
# The CUDA backend's checks that need no GPU (feature cuda): NVRTC and
# ptxas from PyPI (nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12, installed
# into $FLASHATTN_CUDA_VENV, default .cuda-venv, unless that venv already has
# them), then tests/cuda.rs with NVRTC required: every kernel variant to
# PTX for sm_80 and sm_90a, no spills in the main variants (the Hopper
# forward's SASS checked when nvdisasm installs), the kernels
# under host emulation (with a C++20 compiler), the no-driver error; and
# the command line's no-driver test.
set -euo pipefail
cd "$(dirname "$0")/.."

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
export FLASHATTN_PTXAS="$site/nvidia/cuda_nvcc/bin/ptxas" FLASHATTN_REQUIRE_NVRTC=1
if command -v g++ >/dev/null; then export FLASHATTN_CXX=g++; fi

# Both with the workspace's feature set, so the release build of
# scripts/test.sh is reused (with -p alone, wgpu was built twice more).
cargo test --release --workspace --features flashattn-cli/cuda --lib --test cuda "$@"
cargo test --release --workspace --features flashattn-cli/cuda --test cli cuda "$@"
