#!/usr/bin/env bash
# The CUDA half of the GPU check: scripts/gpu-check.sh without its Vulkan
# step (9), whose 70 s go to the CUDA accuracy tests (100 s) and the
# forward and backward benchmarks (110 s); step 8's `bench --decode` (CUDA
# rows against the device-to-device copy, 55 s) is the same in both; the
# same folder (.gpu-check) and the same modes:
#
#   scripts/cuda-check.sh prepare   # with the Rust toolchain: .gpu-check/ (at most 64 MiB)
#   scripts/cuda-check.sh run       # on the NVIDIA machine: steps 1-8 and the summary,
#                                   # 415 s of step limits; logs under $OUT (cuda-check-out)
#   scripts/cuda-check.sh dry       # anywhere: every step that needs no GPU
#
# See scripts/gpu-check.sh for the steps and docs/gpu-checks.md for what to send back.
set -euo pipefail
cd "$(dirname "$0")/.."
FLASHATTN_CHECK_PARTS=cuda exec scripts/gpu-check.sh "$@"
