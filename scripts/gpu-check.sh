#!/usr/bin/env bash
# The whole GPU check for a lent NVIDIA machine (the `device` tool's H200),
# in two halves, because that machine has no Rust toolchain and no network:
#
#   scripts/gpu-check.sh prepare   # here: builds the release binaries the check
#                                  # runs, strips them into .gpu/bin, and fetches
#                                  # the Vulkan loader .debs into .gl/ (both ignored)
#   scripts/gpu-check.sh run       # there (carry .gpu and .gl): the GPU test
#                                  # suites on NVIDIA's Vulkan driver, then plan,
#                                  # demo, forward/backward and decode benchmarks,
#                                  # the autotuner's choices (tune.log, tune.json);
#                                  # the coop kernel (cooperative matrices) gets
#                                  # its own plan, test and bench steps
#
# `run` writes every log under $OUT (or ./gpu-check-out) and ends with a
# summary line per step; it is sized to finish in about 8 minutes on an H200.
set -uo pipefail
cd "$(dirname "$0")/.."

# The test binaries that need an adapter (each runs alone: the suites are
# one process each, as in CI).
SUITES=(gpu_forward gpu_backward gpu_decode gpu_tune io_accounting backend)

prepare() {
  set -e
  rm -rf .gpu && mkdir -p .gpu/bin
  # The CLI with the CUDA backend built in (the rest behaves as without it):
  # one binary for every step keeps .gpu within what a run can carry.
  cargo build --release -p flashattn-cli --features cuda --bin flashattn
  cargo build --release --example decode
  local json
  json=$(cargo test --release -p flashattn --no-run --message-format=json 2>/dev/null)
  for suite in "${SUITES[@]}"; do
    local exe
    exe=$(printf '%s\n' "$json" | grep -o "\"executable\":\"[^\"]*/deps/${suite}-[0-9a-f]*\"" |
      tail -n 1 | cut -d'"' -f4)
    [ -n "$exe" ] || { echo "gpu-check: no test binary for $suite" >&2; exit 1; }
    cp "$exe" ".gpu/bin/$suite"
  done
  cp target/release/flashattn target/release/examples/decode .gpu/bin/
  # The CUDA backend's test binary (the machine has the driver and CUDA's
  # NVRTC; `run` finds the latter).
  json=$(cargo test --release -p flashattn --features cuda --test cuda --no-run --message-format=json 2>/dev/null)
  exe=$(printf '%s\n' "$json" | grep -o '"executable":"[^"]*/deps/cuda-[0-9a-f]*"' | tail -n 1 | cut -d'"' -f4)
  [ -n "$exe" ] || { echo "gpu-check: no CUDA test binary" >&2; exit 1; }
  cp "$exe" .gpu/bin/cuda
  strip .gpu/bin/*
  # NVIDIA's driver brings its Vulkan ICD but not the loader (device README).
  if [ ! -d .gl ] || ! ls .gl/*.deb >/dev/null 2>&1; then
    mkdir -p .gl /tmp/amd64/partial
    local o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
  fi
  du -sh .gpu .gl
  echo "gpu-check: prepared; on the device: run with carry [.gpu, .gl] and command 'scripts/gpu-check.sh run'"
}

step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$out/summary.txt"
}

run() {
  out=${OUT:-gpu-check-out}
  mkdir -p "$out"
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
  if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  fi
  export FLASHATTN_REQUIRE_GPU=1 XDG_RUNTIME_DIR=/tmp WGPU_BACKEND=vulkan
  local bin=.gpu/bin
  { nvidia-smi; lscpu | grep 'Model name'; } >"$out/machine.txt" 2>&1
  step plan 60 "$bin/flashattn" plan
  step plan-decode 60 "$bin/flashattn" plan --decode --head-dim 128 --heads-q 32 --heads-kv 8 --cache-len 8192 --precision f16
  step demo 120 "$bin/flashattn" demo
  # The coop kernel: the planner's reason, then its test against the f64
  # reference (it says SKIPPED in its log where wgpu reports no cooperative
  # matrices; the full gpu_forward suite below runs it by default for f16).
  step plan-coop 60 "$bin/flashattn" plan --head-dim 128 --precision f16
  step test-coop 240 "$bin/gpu_forward" coop_kernel --nocapture
  for suite in "${SUITES[@]}"; do
    step "test-$suite" 240 "$bin/$suite" --test-threads 4
  done
  step bench-forward 240 "$bin/flashattn" bench --seqlens 1024,2048,4096,8192,16384 --head-dims 64,128 \
    --impls flash,tiled,registers,naive,cpu \
    --passes forward --causal both --heads 8 --repeats 5 --json "$out/bench-forward.json"
  # f16 forward: flash is the planner's choice (coop where the device has
  # cooperative matrices), tiled the tiled kernel forced, side by side.
  step bench-forward-coop 240 "$bin/flashattn" bench --seqlens 1024,4096,16384 --head-dims 64,128 \
    --passes forward --causal both --heads 8 --repeats 5 --precision f16 --impls flash,tiled \
    --json "$out/bench-forward-coop.json"
  step bench-backward 240 "$bin/flashattn" bench --seqlens 1024,4096,8192 --head-dims 64,128 \
    --impls flash,tiled,registers,naive,cpu \
    --passes backward --heads 8 --repeats 3 --json "$out/bench-backward.json"
  step bench-decode 240 "$bin/flashattn" bench --decode --splits planner,1,4,16 --repeats 5 \
    --json "$out/bench-decode.json"
  step example-decode 120 "$bin/decode" --tokens 256
  # The autotuner's choices at N 8192, and `plan` showing them.
  step tune 180 "$bin/flashattn" tune --seqlens 8192 --head-dim 64,128 --precision f16,f32 \
    --pass both --heads 8 --repeats 3 --cache-dir "$out/tune-cache" --json "$out/tune.json"
  step plan-tuned 60 "$bin/flashattn" plan --seqlen 8192 --precision f16 --cache-dir "$out/tune-cache"
  cuda_steps "$bin"
  cat "$out/summary.txt"
}

# find_nvrtc: scripts/nvrtc.sh (shared with the other device script).
. scripts/nvrtc.sh

# The CUDA backend on the device: the accuracy matrix, determinism and bad
# inputs (tests/cuda.rs, a missing device fails), then a forward and a
# backward through the CLI (scripts/cuda-check.sh adds the benchmark).
cuda_steps() {
  local bin=$1
  find_nvrtc
  # The compile, ptxas and emulation tests need no GPU and run in CI.
  FLASHATTN_REQUIRE_NVRTC=1 step test-cuda 300 "$bin/cuda" --test-threads 1 \
    --skip every_kernel_variant --skip main_variants --skip host_emulation
  local d=/tmp/cuda-cli qkv
  mkdir -p "$d"
  python3 -c "import numpy as n, sys; r = n.random.default_rng(0)
for x in 'q k v do'.split(): n.save(sys.argv[1] + '/' + x + '.npy', r.standard_normal((4, 1024, 16, 128)).astype(n.float16))" "$d" ||
    echo "gpu-check: no numpy: the CLI steps have no inputs" >&2
  qkv=(--q "$d/q.npy" --k "$d/k.npy" --v "$d/v.npy")
  step cuda-forward 120 "$bin/flashattn" forward --backend cuda --causal "${qkv[@]}" --out "$d/o.npy" --lse "$d/lse.npy"
  step cuda-backward 120 "$bin/flashattn" backward --backend cuda --causal "${qkv[@]}" --do "$d/do.npy" \
    --dq "$d/dq.npy" --dk "$d/dk.npy" --dv "$d/dv.npy"
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
*)
  echo "usage: scripts/gpu-check.sh prepare|run" >&2
  exit 2
  ;;
esac
