#!/usr/bin/env bash
# The browser test: builds web/ (wasm32 + wasm-bindgen, web/build.sh), then
# loads the page in headless Chromium with WebGPU enabled and asserts its
# accuracy checks (test in web/test/browser.mjs). Installs what is missing:
# the wasm32 target and wasm-bindgen-cli (web/build.sh), Debian `chromium`
# (as root, via apt) and playwright-core (npm ci, from web/package-lock.json).
# Fails, never skips, when the page's checks fail or no WebGPU adapter exists.
# The page is built with the `page-test` profile (release without LTO; set
# WEB_PROFILE=release to test the deployed build). Prints each step's time.
set -euo pipefail
# SCREENSHOT and RESULTS (see web/test/browser.mjs) are relative to the caller's directory.
for var in SCREENSHOT RESULTS; do
  if [ -n "${!var:-}" ]; then export "$var=$(realpath -m "${!var}")"; fi
done
cd "$(dirname "$0")/../web"
start=$(date +%s)
# shellcheck source=scripts/steps.sh
source ../scripts/steps.sh

need_root() {
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test-web.sh: $1 is missing; run as root to install it (apt-get install $2)" >&2
    exit 1
  fi
}

chromium_bin=${CHROMIUM:-/usr/bin/chromium}
install_chromium() {
  if [ -x "$chromium_bin" ]; then return 0; fi
  need_root "$chromium_bin" chromium
  echo "scripts/test-web.sh: installing Debian chromium"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
}
install_node() {
  if command -v npm >/dev/null; then return 0; fi
  need_root "node/npm" "nodejs npm"
  echo "scripts/test-web.sh: installing nodejs and npm"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
}
install_playwright() {
  if [ -d node_modules/playwright-core ]; then return 0; fi
  npm ci --no-audit --no-fund --loglevel=error
}
step "chromium (apt, when missing)" install_chromium
step "node and npm (apt, when missing)" install_node
step "playwright-core (npm ci, when missing)" install_playwright
step "the page (web/build.sh)" env WEB_PROFILE="${WEB_PROFILE:-page-test}" ./build.sh
step "the page's checks in Chromium (test/browser.mjs)" env CHROMIUM="$chromium_bin" node test/browser.mjs
echo "scripts/test-web.sh: finished in $(( $(date +%s) - start )) s:"
print_steps
