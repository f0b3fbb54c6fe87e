#!/usr/bin/env bash
# Build the web page: the flashattn library compiled to wasm32 with
# wasm-bindgen, into web/pkg/. Installs what it needs when missing: the
# wasm32 target and wasm-bindgen-cli at the exact version web/Cargo.lock pins
# (the CLI and the crate must match). Runs wasm-opt when it is on PATH or in
# web/node_modules/.bin (npm package `binaryen`). Then: web/serve.sh.
# WEB_PROFILE picks the cargo profile (default release; the browser test
# builds `page-test`, release without LTO, see Cargo.toml).
set -euo pipefail
cd "$(dirname "$0")"

if ! rustup target list --installed | grep -qx wasm32-unknown-unknown; then
  echo "web/build.sh: adding the wasm32-unknown-unknown target"
  rustup target add wasm32-unknown-unknown
fi

# The version of the wasm-bindgen crate in Cargo.lock (package entry, not a dependency line).
version=$(awk '/^name = "wasm-bindgen"$/ { getline; gsub(/version = |"/, ""); print; exit }' Cargo.lock)
if [ -z "$version" ]; then
  echo "web/build.sh: no wasm-bindgen entry in web/Cargo.lock" >&2
  exit 1
fi
if [ "$(wasm-bindgen --version 2>/dev/null | awk '{print $2}')" != "$version" ]; then
  echo "web/build.sh: installing wasm-bindgen-cli $version (once)"
  # Not --locked: the CLI's own lockfile pins a crate version the registry may lack.
  # Only the wasm-bindgen binary, without the test runner's TLS (rustls and
  # ring, the longest part of a cold build), unoptimised: it runs for a
  # second on this crate's module (same output), and compiles in 40% of the
  # CPU time opt-level 1 takes.
  t0=$(date +%s)
  CARGO_PROFILE_RELEASE_OPT_LEVEL=0 \
    cargo install wasm-bindgen-cli --version "$version" --no-default-features --bin wasm-bindgen
  echo "web/build.sh: installed wasm-bindgen-cli in $(( $(date +%s) - t0 )) s"
fi

# Where cargo puts the wasm (web/target unless CARGO_TARGET_DIR or a config says otherwise).
target_dir=$(cargo metadata --format-version 1 --no-deps | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
profile=${WEB_PROFILE:-release}
t0=$(date +%s)
cargo build --profile "$profile" --target wasm32-unknown-unknown
echo "web/build.sh: built the wasm ($profile profile) in $(( $(date +%s) - t0 )) s"
rm -rf pkg
wasm-bindgen --target web --no-typescript --out-dir pkg \
  "$target_dir/wasm32-unknown-unknown/$profile/flashattn_web.wasm"

wasm=pkg/flashattn_web_bg.wasm
wasm_opt=$(command -v wasm-opt || true)
[ -z "$wasm_opt" ] && [ -x node_modules/.bin/wasm-opt ] && wasm_opt=node_modules/.bin/wasm-opt
if [ -n "$wasm_opt" ]; then
  "$wasm_opt" -O3 --enable-bulk-memory --enable-nontrapping-float-to-int --enable-sign-ext \
    --enable-mutable-globals "$wasm" -o "$wasm.opt"
  mv "$wasm.opt" "$wasm"
  opt_note="after wasm-opt"
else
  opt_note="no wasm-opt found (optional: npm install binaryen in web/)"
fi
raw=$(stat -c %s "$wasm")
gz=$(gzip -9 -c "$wasm" | wc -c)
echo "web/build.sh: built web/pkg ($wasm: $raw bytes raw, $gz gzip -9; $opt_note)"
