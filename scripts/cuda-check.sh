#!/usr/bin/env bash
# The CUDA backend's GPU check for a lent NVIDIA machine (the `device`
# tool's H200: driver, CUDA 13, PyTorch with CUDA, no Rust, no network), in
# two halves like scripts/gpu-check.sh:
#
#   scripts/cuda-check.sh prepare   # here: release CLI with the cuda feature and
#                                   # tests/cuda.rs's binary, stripped into
#                                   # .cuda-check/bin (ignored), and the Vulkan
#                                   # loader .debs into .gl/ (for the wgpu rows)
#   scripts/cuda-check.sh run       # there, with carry [".cuda-check", ".gl"]:
#
#   1. tests/cuda.rs with FLASHATTN_REQUIRE_GPU=1 (a missing device fails): the
#      accuracy matrix on --backend cuda on every kernel path (the chosen one —
#      on an H200 the Hopper forward —, scalar, and on Hopper the sm80 mma
#      kernels forced), the backward twice bit for bit, the layouts' cases
#      (ALiBi, sinks, block masks, packed batches) and decoding, what stays
#      Unsupported, the plan picking tensor cores on the device (the NVRTC/ptxas/emulation tests
#      run here, not there: they need no GPU);
#   2. `flashattn plan --backend cuda` from the device's own properties;
#   3. one benchmark, batch 4, 16 heads, d 64/128, causal and not, f16 and
#      bf16, forward and backward, TFLOP/s as `flashattn bench` counts FLOPs
#      (4·N²·d·heads·batch, halved for causal, ×2.5 for the backward):
#      the forward as cuda-hopper (wgmma + TMA, forced) against cuda-mma (the
#      sm80 kernels, forced) and torch SDPA on the GPU at N 1k/4k/16k, the
#      backward as cuda (the sm80 tensor-core backward) and torch at N
#      1k/4k/8k, cuda-scalar and the wgpu Vulkan tiled kernels at N 1k/4k
#      (they are slower; longer would not fit the time).
#
# `run` writes its logs, bench-*.json, cuda-bench.json (every row) and
# cuda-bench.txt (the table) under $OUT (or ./cuda-check-out); each step has a
# timeout so the whole run stays under about 8 minutes. Without an NVIDIA
# driver it stops at once with exit status 3, saying so.
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=.cuda-check/bin

prepare() {
  set -e
  rm -rf .cuda-check && mkdir -p "$BIN"
  cargo build --release -p flashattn-cli --features cuda --bin flashattn
  local json exe
  json=$(cargo test --release -p flashattn --features cuda --test cuda --no-run --message-format=json 2>/dev/null)
  exe=$(printf '%s\n' "$json" | grep -o '"executable":"[^"]*/deps/cuda-[0-9a-f]*"' | tail -n 1 | cut -d'"' -f4)
  [ -n "$exe" ] || { echo "cuda-check: no CUDA test binary" >&2; exit 1; }
  cp target/release/flashattn "$BIN/flashattn"
  cp "$exe" "$BIN/cuda"
  strip "$BIN"/*
  # NVIDIA's driver brings its Vulkan ICD but not the loader (device README).
  if [ ! -d .gl ] || ! ls .gl/*.deb >/dev/null 2>&1; then
    mkdir -p .gl /tmp/amd64/partial
    local o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
    # shellcheck disable=SC2086
    apt-get $o update -qq
    # shellcheck disable=SC2086
    (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
  fi
  local kib
  kib=$(du -sk .cuda-check .gl | awk '{s += $1} END {print s}')
  du -sh .cuda-check .gl
  if [ "$kib" -gt $((60 * 1024)) ]; then
    echo "cuda-check: .cuda-check and .gl hold ${kib} KiB, over what a run can carry (64 MiB with the tree)" >&2
    exit 1
  fi
  echo "cuda-check: prepared; on the device: carry [.cuda-check, .gl], command 'scripts/cuda-check.sh run'"
}

step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  printf '%-26s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$out/summary.txt"
  return $rc
}

# find_nvrtc: scripts/nvrtc.sh (shared with the other device script).
. scripts/nvrtc.sh

# One `flashattn bench` run per precision, pass list and implementation set.
bench() {
  local name=$1 limit=$2 impls=$3 passes=$4 seqlens=$5 precision=$6
  step "$name" "$limit" "$BIN/flashattn" bench --impls "$impls" --passes "$passes" --seqlens "$seqlens" \
    --head-dims 64,128 --causal both --batch 4 --heads 16 --repeats 3 --precision "$precision" \
    --python python3 --json "$out/$name.json"
}

run() {
  out=${OUT:-cuda-check-out}
  mkdir -p "$out"
  : >"$out/summary.txt"
  if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "cuda-check: no NVIDIA GPU here (nvidia-smi is missing or finds no device): run it on the device machine" |
      tee -a "$out/summary.txt" >&2
    exit 3
  fi
  [ -x "$BIN/flashattn" ] && [ -x "$BIN/cuda" ] ||
    { echo "cuda-check: $BIN is missing: run 'scripts/cuda-check.sh prepare' here first and carry .cuda-check" >&2; exit 2; }
  for f in .gl/*.deb; do [ -e "$f" ] && dpkg -x "$f" /; done
  ldconfig
  if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  fi
  export XDG_RUNTIME_DIR=/tmp WGPU_BACKEND=vulkan FLASHATTN_TORCH_DEVICE=cuda
  export FLASHATTN_CUDA_CACHE=/tmp/flashattn-ptx
  { nvidia-smi; lscpu | grep 'Model name'; python3 -c 'import torch; print("torch", torch.__version__)'; } \
    >"$out/machine.txt" 2>&1
  find_nvrtc
  # Limits: 140 + 20 + 2 × (80 + 60 + 20) = 480 s at most. The tests in
  # four threads: their NVRTC compiles (the host's 16 cores) overlap.
  FLASHATTN_REQUIRE_GPU=1 FLASHATTN_REQUIRE_NVRTC=1 step test-cuda 140 "$BIN/cuda" --test-threads 4 \
    --skip every_kernel_variant --skip main_variants --skip host_emulation
  step plan-cuda 20 "$BIN/flashattn" plan --backend cuda --precision bf16
  for p in f16 bf16; do
    bench "bench-fwd-$p" 80 cuda-hopper,cuda-mma,torch forward 1024,4096,16384 "$p"
    bench "bench-bwd-$p" 60 cuda,torch backward 1024,4096,8192 "$p"
    bench "bench-scalar-tiled-$p" 20 cuda-scalar,tiled forward,backward 1024,4096 "$p"
  done
  table
  cat "$out/summary.txt"
}

# Every bench-*.json row into cuda-bench.json, and a table of TFLOP/s
# (median time) with one column per implementation.
table() {
  python3 - "$out" <<'EOF' | tee "$out/cuda-bench.txt"
import glob, json, os, statistics, sys
out = sys.argv[1]
rows = []
for path in sorted(glob.glob(os.path.join(out, "bench-*.json"))):
    with open(path) as f:
        rows += json.load(f)["results"]
with open(os.path.join(out, "cuda-bench.json"), "w") as f:
    json.dump(rows, f, indent=1)
impls = ["cuda-hopper", "cuda-mma", "cuda", "cuda-scalar", "tiled", "torch"]
cells = {}
for r in rows:
    key = (r["precision"], r["pass"], r["head_dim"], r["causal"], r["seqlen"])
    tf = "-" if not r["seconds"] else "%.1f" % (r["flops"] / statistics.median(r["seconds"]) / 1e12)
    cells.setdefault(key, {})[r["implementation"]] = tf if not r.get("error") else "err"
print("TFLOP/s (median of 3), batch 4, 16 heads; FLOPs as flashattn bench counts them")
print("%-5s %-8s %4s %-6s %6s " % ("prec", "pass", "d", "causal", "N") + " ".join("%11s" % i for i in impls))
for key in sorted(cells):
    prec, pas, d, causal, n = key
    print("%-5s %-8s %4d %-6s %6d " % (prec, pas, d, causal, n) + " ".join("%11s" % cells[key].get(i, "") for i in impls))
EOF
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
*)
  echo "usage: scripts/cuda-check.sh prepare|run" >&2
  exit 2
  ;;
esac
