#!/usr/bin/env bash
# The full test suite on a real Vulkan driver. Installs Mesa's lavapipe (a CPU
# Vulkan driver) when no Vulkan driver is present, and spirv-val (Debian
# spirv-tools) for the shader tests, then runs every test of the workspace
# (library and command line) with GPU tests and SPIR-V validation required:
# a missing adapter or tool fails the run instead of skipping. Ends with the
# browser test (scripts/test-web.sh): the library compiled to wasm32 and
# checked on headless Chromium's WebGPU adapter.
set -euo pipefail
cd "$(dirname "$0")/.."

# Any ICD manifest in either place (ls of both fails when one folder is absent).
have_vulkan_icd() {
  local f
  for f in /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json; do
    [ -e "$f" ] && return 0
  done
  return 1
}
missing=()
have_vulkan_icd || missing+=(mesa-vulkan-drivers)
command -v spirv-val >/dev/null || missing+=(spirv-tools)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test.sh: missing ${missing[*]}; run as root to install them" >&2
    exit 1
  fi
  echo "scripts/test.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

export FLASHATTN_REQUIRE_GPU=1 FLASHATTN_REQUIRE_SPIRV_VAL=1
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
cargo test --release --workspace "$@"

scripts/test-web.sh
