#!/usr/bin/env bash
# The full test suite on a real Vulkan driver. Installs Mesa's lavapipe (a CPU
# Vulkan driver) when no Vulkan driver is present, then runs every test with
# GPU tests required: a missing adapter fails the run instead of skipping.
# Ends with the browser test (scripts/test-web.sh): the library compiled to
# wasm32 and checked on headless Chromium's WebGPU adapter.
set -euo pipefail
cd "$(dirname "$0")/.."

have_vulkan_icd() {
  ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json >/dev/null 2>&1
}
if ! have_vulkan_icd; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test.sh: no Vulkan driver; run as root to install mesa-vulkan-drivers" >&2
    exit 1
  fi
  echo "scripts/test.sh: installing Mesa lavapipe (mesa-vulkan-drivers)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers >/dev/null
fi

export FLASHATTN_REQUIRE_GPU=1
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
cargo test --release "$@"

scripts/test-web.sh
