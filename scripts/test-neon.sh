#!/usr/bin/env bash
# The CPU backend's NEON kernels on an x86 host: the library cross-built for
# aarch64-unknown-linux-gnu and its CPU tests run under QEMU's user-mode
# emulation. Installs what is missing (as root): Debian's qemu-user,
# gcc-aarch64-linux-gnu (the linker) and libc6-dev-arm64-cross, and the
# rustup target. Runs the library's `cpu::` unit tests (the micro-kernels
# bit for bit against their scalar chains and against f64, the vector math)
# and the accuracy matrix of tests/cpu_backend.rs (two cases skipped, see
# below), tests/cpu_layouts.rs and tests/cpu_decode.rs, each on every set
# the emulated CPU has: NEON and portable. Fails unless NEON is the set
# detected first. Correctness only: emulated time says nothing of an ARM
# core's speed.
# Arguments go to both `cargo test` runs (cargo's, e.g. `--jobs 1`).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
target=aarch64-unknown-linux-gnu

missing=()
command -v qemu-aarch64 >/dev/null || missing+=(qemu-user)
command -v aarch64-linux-gnu-gcc >/dev/null || missing+=(gcc-aarch64-linux-gnu)
[ -e /usr/aarch64-linux-gnu/lib/crt1.o ] || missing+=(libc6-dev-arm64-cross)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test-neon.sh: ${missing[*]} missing; run as root to install them" >&2
    exit 1
  fi
  echo "scripts/test-neon.sh: installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! rustup target list --installed | grep -qx "$target"; then
  rustup target add "$target"
fi

# In the environment, not a .cargo/config, so no other build sees them.
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# Every available set runs; the check below needs the detected one unforced.
unset FLASHATTN_CPU_ISA

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release -p flashattn --target "$target" --lib "$@" -- cpu:: 2>&1 | tee "$log"
# The unit test that fails unless NEON comes first must have run, not been filtered out.
if ! grep -q '^test cpu::isa::tests::the_targets_own_kernels_come_first \.\.\. ok$' "$log"; then
  echo "scripts/test-neon.sh: the NEON detection test did not run and pass" >&2
  exit 1
fi
# The accuracy matrix, less the two cases that cost most under emulation
# and check no kernel: the block walk of 600 × 777 sequences (the key splits
# of the decode-shaped cases cross many blocks too) and the backward's split
# into strips on 1, 3 and 16 threads (the same source on every set, run
# natively by scripts/test.sh). Under emulation the two take longer than all
# the tests run here together (docs/testing.md).
cargo test --release -p flashattn --target "$target" \
  --test cpu_backend --test cpu_layouts --test cpu_decode --test kv_quant "$@" -- \
  --skip cpu_long_sequences_cross_many_blocks --skip cpu_backward_strips_on_any_thread_count

echo "scripts/test-neon.sh: passed in $(( $(date +%s) - start )) s"
