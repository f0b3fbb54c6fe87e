#!/usr/bin/env bash
# The full test suite on a real Vulkan driver. Installs Mesa's lavapipe (a CPU
# Vulkan driver) when no Vulkan driver is present, and a spirv-val that knows
# cooperative matrices (scripts/spirv-val.sh), then runs every test of the
# workspace (library, command line, harness, examples) with GPU tests and
# SPIR-V validation required: a missing adapter or tool fails the run
# instead of skipping; beside them the doc tests, the Python package's
# pytest suite (scripts/test-python.sh) and the browser test
# (scripts/test-web.sh: the library compiled to wasm32 and checked on
# headless Chromium's WebGPU adapter). Prints each step's time, and lists what the run checked another
# way on this machine (FLASHATTN_WAIVERS, see docs/testing.md).
# Arguments go to `cargo test --no-run` (e.g. `scripts/test.sh --test
# gpu_forward`), those after `--` to the test binaries (filters).
# FLASHATTN_FULL_MATRIX=1 runs the GPU suites' full matrix of cases.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
# shellcheck source=scripts/steps.sh
source scripts/steps.sh

# The steps' times and the waiver list, whether the run passed or not.
summary() {
  local status=$?
  echo
  if [ "$status" -eq 0 ]; then
    echo "scripts/test.sh: passed in $(( $(date +%s) - start )) s:"
  else
    echo "scripts/test.sh: FAILED (status $status) after $(( $(date +%s) - start )) s:"
  fi
  print_steps
  if [ -s "${FLASHATTN_WAIVERS:-}" ]; then
    echo "What this machine lacks, and what the tests checked instead ($FLASHATTN_WAIVERS):"
    sort -u "$FLASHATTN_WAIVERS" | sed 's/^/  /'
  elif [ -n "${FLASHATTN_WAIVERS:-}" ]; then
    echo "Nothing was waived or checked another way."
  fi
}
trap summary EXIT

# Any ICD manifest in either place (ls of both fails when one folder is absent).
have_vulkan_icd() {
  local f
  for f in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json; do
    [ -e "$f" ] && return 0
  done
  return 1
}
install_lavapipe() {
  if have_vulkan_icd; then return 0; fi
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test.sh: no Vulkan driver; run as root to install mesa-vulkan-drivers" >&2
    exit 1
  fi
  echo "scripts/test.sh: installing mesa-vulkan-drivers"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers >/dev/null
}
step "lavapipe (apt, when missing)" install_lavapipe
spirv_val=
find_spirv_val() { spirv_val=$(scripts/spirv-val.sh); }
step "spirv-val (PyPI, when missing)" find_spirv_val

target_dir=${CARGO_TARGET_DIR:-target}
mkdir -p "$target_dir"
export FLASHATTN_WAIVERS
FLASHATTN_WAIVERS=$(realpath "$target_dir")/waivers.txt
: >"$FLASHATTN_WAIVERS"
export FLASHATTN_REQUIRE_GPU=1 FLASHATTN_REQUIRE_SPIRV_VAL=1 FLASHATTN_SPIRV_VAL="$spirv_val"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
# Lavapipe without LLVM's optimisation passes: the GPU suites' time is mostly
# compiling pipelines (docs/testing.md), and the passes double it. Same values;
# a caller's own GALLIVM_PERF wins.
export GALLIVM_PERF="${GALLIVM_PERF-nopt}"
# Cargo's arguments, and the test binaries' after `--`.
cargo_args=() test_args=() after=0
for a in "$@"; do
  if [ "$after" = 1 ]; then test_args+=("$a"); elif [ "$a" = -- ]; then after=1; else cargo_args+=("$a"); fi
done
messages=$target_dir/test-binaries.json
build_tests() {
  cargo test --release --workspace --no-run --message-format=json-render-diagnostics "${cargo_args[@]}" >"$messages"
}
step "build the tests (cargo test --release --no-run)" build_tests
# The test binaries a few at a time (scripts/run-tests.py: cargo runs them
# one by one, leaving a core idle), beside them the browser test and, for a
# whole run, the doc tests and the Python suite.
extras=(--extra "browser test=scripts/test-web.sh")
if [ ${#cargo_args[@]} -eq 0 ]; then
  extras+=(--extra "doc tests=cargo test --release --workspace --doc")
  # The Python package's build (pip install ./python into the reused
  # virtual environment, torch and transformers from PyPI the first time)
  # and its suite: one job, so the build's single-core stretches overlap
  # the test binaries.
  extras+=(--extra "python tests=scripts/test-python.sh")
fi
step "run the tests, the doc tests, the Python suite and the browser test (scripts/run-tests.py)" \
  python3 scripts/run-tests.py "$messages" --logs "$target_dir/test-logs" "${extras[@]}" -- "${test_args[@]}"
