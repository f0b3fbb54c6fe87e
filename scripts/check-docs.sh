#!/usr/bin/env bash
# The documentation and the crates as a reader and a user meet them:
#
# 1. tests/docs.rs: every relative link and anchor in README.md, CHANGELOG.md
#    and docs/*.md leads to a tracked file and heading; README.md within 200
#    lines, its Rust example examples/quickstart.rs verbatim; no absolute path
#    of a machine in tracked text files; no contract outside the repository
#    (docs/semantics.md is the contract);
# 2. cargo doc of the workspace with warnings as errors;
# 3. cargo publish --dry-run of flashattn and flashattn-cli: both packaged
#    and built from their .crate files, the CLI against the packaged library.
#
# Arguments go to `cargo publish` (e.g. --allow-dirty while editing).
set -euo pipefail
cd "$(dirname "$0")/.."

step() {
  local name=$1 start=$SECONDS
  shift
  "$@"
  echo "scripts/check-docs.sh: $name took $((SECONDS - start)) s"
}

step "links, paths and the README example" cargo test --release --test docs
step "cargo doc" env RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
# Cargo takes a registry package as it first unpacked and built it, so the
# packaged library of an earlier run would serve the CLI's verification
# stale: its unpacked sources and its build are removed first (a minute of
# rebuilding the two).
rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/flashattn-[0-9]* \
  "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/flashattn-cli-[0-9]*
cargo clean -q --profile dev -p flashattn -p flashattn-cli
step "cargo publish --dry-run" cargo publish --workspace --dry-run "$@"
