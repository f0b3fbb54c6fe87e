#!/usr/bin/env bash
# The GPU check: what to run on an NVIDIA machine (its driver, CUDA, PyTorch
# with CUDA; no Rust toolchain and no network needed there), in two halves,
# and a dry mode for a machine without a GPU:
#
#   scripts/gpu-check.sh prepare  # with the Rust toolchain and a network (no GPU needed):
#                                 # everything `run` uses, into .gpu-check/ (at most
#                                 # 64 MiB, checked), to copy into the checkout there:
#                                 # the stripped binaries (bin.tar.gz), the Vulkan
#                                 # loader .debs, compute-sanitizer (sanitizer.tar.gz)
#   scripts/gpu-check.sh run      # on the NVIDIA machine: the ten steps below, their
#                                 # time limits summing to 415 s; logs, JSON and
#                                 # summary.txt under $OUT (default gpu-check-out)
#   scripts/gpu-check.sh dry      # anywhere: every step that needs no GPU
#
# run, in order (each step's limit in seconds):
#    1 env       10  nvidia-smi -q (name, driver, clocks, power limit), the CUDA
#                    driver's and NVRTC's versions, the device and its plan, the
#                    Vulkan adapter (flashattn plan), torch's version
#    2 warm      28  the PTX disk cache filled over all cores (bounded-wait and
#                    plain Hopper builds); the driver's JIT cache fills as steps load
#    3 smoke     30  the Hopper forward's smoke test, alone, CUDA_LAUNCH_BLOCKING=1,
#                    against the sm80 kernels and the f64 reference; if it fails,
#                    every later step runs with FLASHATTN_CUDA_KERNEL=no-hopper
#    4 (steps 3, 6 and 7 run with FLASHATTN_CUDA_BOUNDED_WAIT_MS: a deadlocked
#      mbarrier wait prints block, thread, barrier and phase, then traps)
#    5 jit       32  every main variant loaded by the driver's JIT with its logs
#                    (registers, spills, shared memory); fails if the Hopper
#                    forward spills or its log reports serialized wgmma (the
#                    plain build users run: the bounded waits' report is a
#                    printf call, which serializes them)
#    6 sanitize  50  compute-sanitizer (memcheck, synccheck; racecheck on the sm80
#                    kernels) on tiny cases
#    7 accuracy  70  the CUDA accuracy tests, one kernel path per process, each
#                    case printed as it finishes; `flashattn doctor --backend cuda`
#    8 bench    125  forward (Hopper, sm80, torch SDPA) and backward (sm80, torch)
#                    by examples/bench_paths.rs: CUDA events, inputs once per shape,
#                    torch started once, JSON after every case, outputs compared;
#                    then `flashattn bench --decode --backends cuda` (every
#                    cache dtype at 8k and 32k, batch 1 and 8, and the MLA shape)
#                    against the device-to-device copy bandwidth, CSV and JSON
#    9 vulkan    70  the same on NVIDIA's Vulkan driver: `flashattn doctor` and the
#                    decode example (smoke), the wgpu accuracy suites, and the
#                    registers, coop and tiled kernels against torch SDPA on CUDA
#   10 summary       every step's status and time, every failure; exit status 1
#                    when anything failed
#
# scripts/cuda-check.sh is this script without step 9 (its 70 s go to steps 7
# and 8). Without an NVIDIA driver, `run` stops at once with one line and exit
# status 3. docs/gpu-checks.md says what each step records and what to send back.
set -uo pipefail
cd "$(dirname "$0")/.."

DIR=.gpu-check
# Where run and dry unpack the binaries (set by unpack).
BIN=
# Where prepare keeps its downloads between runs (ignored with target/).
DOWNLOADS=target/gpu-check-downloads
MAX_BYTES=$((64 * 1024 * 1024))
# cuda: steps 1-8 only (scripts/cuda-check.sh); all: every step.
PARTS=${FLASHATTN_CHECK_PARTS:-all}
NAME=$([ "$PARTS" = cuda ] && echo cuda-check || echo gpu-check)
SANITIZER_WHEEL=nvidia-cuda-sanitizer-api-cu12==12.9.79
VULKAN_DEBS=(libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
TEST_BINARIES=(cuda gpu_forward gpu_backward gpu_decode gpu_kv_quant)
# Every step's limit: they sum to 415 s in both scripts.
if [ "$PARTS" = cuda ]; then
  LIMIT_ACCURACY=100 LIMIT_BENCH_FWD=65 LIMIT_BENCH_BWD=45 LIMIT_VULKAN=0
else
  LIMIT_ACCURACY=70 LIMIT_BENCH_FWD=40 LIMIT_BENCH_BWD=30 LIMIT_VULKAN=70
fi
LIMIT_ENV=10 LIMIT_WARM=28 LIMIT_SMOKE=30 LIMIT_JIT=32 LIMIT_SANITIZE=50
# bench --decode's two runs in step 8 (dense caches, then the MLA shape).
LIMIT_DECODE=40 LIMIT_DECODE_MLA=15
BOUNDED_WAIT_MS=4000

# The accuracy tests of tests/cuda.rs (libtest's filters, any of them).
ACCURACY_TESTS=(forward_meets backward_meets layouts_meet layouts_backward dropout_meets
  decoding_matches a_device_cache_step latent_caches_match_the_reference_on_the_device
  a_device_latent_cache what_stays f16_and_bf16_run shards_merge)
# The benchmarks' arguments (run and the dry mode's argument check).
BENCH_SHAPE=(--batch 4 --heads 16 --repeats 3 --causal both --head-dims 64,128)
bench_cuda_forward() {
  local impls=cuda-hopper,cuda-mma,torch compare=()
  [ "${HOPPER_OFF:-0}" = 1 ] && impls=cuda-mma,torch compare=(--compare-with cuda-scalar)
  echo --impls "$impls" "${compare[@]}" --passes forward --seqlens 1024,8192 \
    --precisions bf16 "${BENCH_SHAPE[@]}"
}
BENCH_CUDA_BACKWARD=(--impls cuda,torch --compare-with cuda-scalar --passes backward
  --seqlens 1024,4096 --precisions bf16 "${BENCH_SHAPE[@]}")
BENCH_VULKAN_FORWARD=(--impls registers,coop,tiled,torch --compare-with registers --passes forward
  --seqlens 1024 --precisions f16 "${BENCH_SHAPE[@]}")
BENCH_VULKAN_BACKWARD=(--impls registers,tiled,torch --passes backward --seqlens 1024
  --precisions f16 "${BENCH_SHAPE[@]}")
# `flashattn bench --decode`: the CUDA rows on a device cache uploaded once
# (kernel time, CUDA events) against the device-to-device copy (the CPU
# backend's rows are measured off the device); the sizes apart, so the dry
# mode runs the same flags tiny.
DECODE_SIZES=(--cache-lens 8192,32768 --batches 1,8 --max-tokens 0)
DECODE_DENSE=(--backends cuda --heads-q 32 --heads-kv 8 --head-dim 128
  --dtypes f16,bf16,f32,int8,fp8 --splits planner,1 --repeats 3)
DECODE_MLA=(--mla --backends cuda --dtypes f16,int8,fp8 --splits planner --repeats 3)

die() {
  echo "$NAME: $*" >&2
  exit "${RC:-1}"
}

# ---------------------------------------------------------------- prepare

# The release build's path of test binary $1 (cargo's JSON messages in $2).
test_binary() {
  printf '%s\n' "$2" | grep -o "\"executable\":\"[^\"]*/deps/$1-[0-9a-f]*\"" | tail -n 1 | cut -d'"' -f4
}

prepare() {
  set -e
  local bin=$DIR/bin
  rm -rf "$DIR" && mkdir -p "$bin" "$DIR/debs" "$DOWNLOADS"
  # One feature set for every binary (the CUDA backend built in, as
  # scripts/test-cuda.sh builds it, so the two builds share their artifacts).
  local features=(--release --workspace --features flashattn-cli/cuda)
  cargo build "${features[@]}" --bin flashattn --example decode --example bench_paths
  local json tests=() t exe
  for t in "${TEST_BINARIES[@]}"; do tests+=(--test "$t"); done
  json=$(cargo test "${features[@]}" "${tests[@]}" --no-run --message-format=json 2>/dev/null)
  for t in "${TEST_BINARIES[@]}"; do
    exe=$(test_binary "$t" "$json")
    [ -n "$exe" ] || die "no test binary for tests/$t.rs"
    cp "$exe" "$bin/$t"
  done
  cp target/release/flashattn target/release/examples/decode target/release/examples/bench_paths "$bin/"
  strip "$bin"/*
  prepare_debs
  prepare_sanitizer
  {
    echo "commit $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
    echo "built $(date -u +%Y-%m-%dT%H:%MZ) by $(rustc --version)"
    echo "sanitizer $SANITIZER_WHEEL"
    (cd "$DIR" && find . -type f ! -name MANIFEST -printf '%s %p\n' | sort -k2)
  } >"$DIR/MANIFEST"
  # Stripped, the binaries are about 55 MB; gzip makes them about 22 (xz
  # would make 11, at ten times the time).
  tar -czf "$DIR/bin.tar.gz" -C "$DIR" bin
  rm -rf "$bin"
  echo "$(stat -c %s "$DIR/bin.tar.gz") ./bin.tar.gz (the above bin/)" >>"$DIR/MANIFEST"
  check_size
  echo "$NAME: prepared $DIR; copy it into the checkout on the NVIDIA machine and run 'scripts/$NAME.sh run' there"
}

# NVIDIA's driver brings its Vulkan ICD but a machine may lack the loader:
# the Debian packages, unpacked by `run` into a private folder.
prepare_debs() {
  local cache=$DOWNLOADS/debs lists=$DOWNLOADS/apt-lists
  mkdir -p "$cache" "$lists/partial"
  if ! ls "$cache"/libvulkan1_*.deb >/dev/null 2>&1; then
    local o=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 "-oDir::State::Lists=$PWD/$lists")
    apt-get "${o[@]}" update -qq
    (cd "$cache" && apt-get "${o[@]}" download "${VULKAN_DEBS[@]}")
  fi
  cp "$cache"/*.deb "$DIR/debs/"
}

# compute-sanitizer from PyPI's wheel: the tool and the libraries it loads
# from its own folder, nothing else (no headers), as one archive.
prepare_sanitizer() {
  local cache=$DOWNLOADS/sanitizer wheel flat
  mkdir -p "$cache"
  wheel=$(ls "$cache"/nvidia_cuda_sanitizer_api_cu12-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    python3 -m pip download -q --no-deps -d "$cache" "$SANITIZER_WHEEL"
    wheel=$(ls "$cache"/nvidia_cuda_sanitizer_api_cu12-*.whl | head -n 1)
  fi
  flat=$(mktemp -d)
  python3 - "$wheel" "$flat" <<'EOF'
import os, sys, zipfile
wheel, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.endswith("/bin/compute-sanitizer") or (name.endswith(".so") and "/lib/" in name):
            path = os.path.join(out, os.path.basename(name))
            with open(path, "wb") as f:
                f.write(z.read(name))
            os.chmod(path, 0o755)
EOF
  [ -x "$flat/compute-sanitizer" ] || die "no compute-sanitizer in $wheel"
  tar -czf "$DIR/sanitizer.tar.gz" -C "$flat" .
  rm -rf "$flat"
}

# The folder within 64 MiB, or a failure listing what takes the room.
check_size() {
  local bytes
  bytes=$(find "$DIR" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
  echo "$NAME: $DIR holds $((bytes / 1024)) KiB of at most $((MAX_BYTES / 1024)) KiB"
  if [ "$bytes" -gt "$MAX_BYTES" ]; then
    find "$DIR" -type f -printf '%s %p\n' | sort -rn >&2
    die "$DIR holds $bytes bytes, over 64 MiB"
  fi
}

# -------------------------------------------------------------------- run

# `step NAME LIMIT COMMAND...`: COMMAND under a hard timeout, its output in
# $out/NAME.log, one summary line (status and seconds); status 0 or the
# command's (124: the limit).
step() {
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS rc status
  timeout --kill-after=5 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  case $rc in
  0) status=ok ;;
  124 | 137) status="TIMEOUT after ${limit} s" ;;
  *) status="FAILED (exit status $rc)" ;;
  esac
  if grep -q '^WAIVED' "$out/$name.log"; then status="$status, waived: $(grep -c '^WAIVED' "$out/$name.log")"; fi
  printf '%-24s %4s s of %4s  %s\n' "$name" "$((SECONDS - start))" "$limit" "$status" >>"$out/summary.txt"
  return $rc
}

# A step of the summary that did not run, and why.
skipped() {
  printf '%-24s %4s      %4s  skipped: %s\n' "$1" - - "$2" >>"$out/summary.txt"
}

# `flashattn doctor` where this build has it (it checks for the subcommand).
has_doctor() {
  "$BIN/flashattn" doctor --help >/dev/null 2>&1
}

# The packed binaries into a fresh folder $work (BIN: its bin/).
unpack() {
  [ -f "$DIR/bin.tar.gz" ] && [ -f "$DIR/MANIFEST" ] ||
    RC=2 die "$DIR is missing: run 'scripts/$NAME.sh prepare' where the Rust toolchain is, and copy $DIR here"
  work=$(mktemp -d -t flashattn-gpu-check.XXXXXX)
  tar -xzf "$DIR/bin.tar.gz" -C "$work"
  BIN=$work/bin
  # The tests/cuda.rs binary, printing as it goes (each test's lines whole).
  CUDA_TESTS=("$BIN/cuda" --nocapture)
}

# Unpacks what `prepare` packed: the binaries, the sanitizer, and the
# Vulkan loader where the machine has none; finds NVIDIA's Vulkan ICD and NVRTC.
setup() {
  unpack
  mkdir -p "$work/sanitizer" "$work/vulkan"
  tar -xzf "$DIR/sanitizer.tar.gz" -C "$work/sanitizer"
  export FLASHATTN_CUDA_CACHE=$work/ptx CUDA_CACHE_PATH=$work/nv-jit XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
  if ! ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so\.1 '; then
    local f
    for f in "$DIR"/debs/*.deb; do dpkg -x "$f" "$work/vulkan"; done
    export LD_LIBRARY_PATH="$work/vulkan/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "vulkan loader: the packed one ($work/vulkan)" >>"$out/machine.txt"
  fi
  local icd
  for icd in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
    /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; do
    if [ -f "$icd" ]; then
      export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
      break
    fi
  done
  local egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
  [ -f "$egl" ] && export __EGL_VENDOR_LIBRARY_FILENAMES=$egl
  echo "vulkan icd: ${VK_DRIVER_FILES:-none found}" >>"$out/machine.txt"
  find_nvrtc
}

# find_nvrtc: scripts/nvrtc.sh.
. scripts/nvrtc.sh

run() {
  out=${OUT:-$NAME-out}
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    RC=3 die "no NVIDIA driver here (nvidia-smi is missing): run this on an NVIDIA machine with its driver"
  fi
  if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    RC=3 die "nvidia-smi lists no GPU: run this on an NVIDIA machine with its driver"
  fi
  [ -f "$DIR/bin.tar.gz" ] ||
    RC=2 die "$DIR is missing: run 'scripts/$NAME.sh prepare' where the Rust toolchain is, and copy $DIR here"
  mkdir -p "$out" && rm -f "$out"/*.log "$out"/*.json "$out/summary.txt"
  : >"$out/machine.txt"
  setup
  echo "$NAME: logs and summary in $out (steps of at most $((LIMIT_ENV + LIMIT_WARM + LIMIT_SMOKE + LIMIT_JIT +
    LIMIT_SANITIZE + LIMIT_ACCURACY + LIMIT_BENCH_FWD + LIMIT_BENCH_BWD + LIMIT_DECODE + LIMIT_DECODE_MLA +
    LIMIT_VULKAN)) s)"
  export FLASHATTN_REQUIRE_GPU=1 FLASHATTN_TORCH_DEVICE=cuda
  wanted 1 && step_env
  wanted 2 && step_warm
  wanted 3 && step_smoke
  wanted 5 && step_jit
  wanted 6 && step_sanitize
  wanted 7 && step_accuracy
  wanted 8 && step_bench
  if [ "$PARTS" != all ]; then
    skipped 9-vulkan "scripts/cuda-check.sh runs the CUDA steps only"
  elif wanted 9; then
    step_vulkan
  fi
  summary
}

# Whether step $1 runs: FLASHATTN_CHECK_STEPS (numbers, e.g. "2 5 9") reruns
# some steps only; the others are listed as skipped.
wanted() {
  [ -z "${FLASHATTN_CHECK_STEPS:-}" ] && return 0
  case " $FLASHATTN_CHECK_STEPS " in
  *" $1 "*) return 0 ;;
  esac
  skipped "$1" "not in FLASHATTN_CHECK_STEPS"
  return 1
}

# 1: the machine, its driver, NVRTC, the device, the Vulkan adapter.
step_env() {
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem,power.limit,memory.total --format=csv
    lscpu | grep -E 'Model name|^CPU\(s\)'
    echo "kernel $(uname -r)"
    echo "compute-sanitizer: $(sanitizer)"
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    cat "$DIR/MANIFEST"
  } >>"$out/machine.txt" 2>&1
  step 1-nvidia-smi "$LIMIT_ENV" nvidia-smi -q &
  step 1-cuda-device "$LIMIT_ENV" "${CUDA_TESTS[@]}" --exact the_device_and_its_toolchain &
  WGPU_BACKEND=vulkan step 1-vulkan-adapter "$LIMIT_ENV" "$BIN/flashattn" plan &
  step 1-cuda-plan "$LIMIT_ENV" "$BIN/flashattn" plan --backend cuda --precision bf16 --head-dim 128 &
  wait
}

# 2: the PTX of every variant the later steps load: the Hopper forward
# with its waits bounded (steps 3, 6, 7) and plain (steps 5, 8).
step_warm() {
  FLASHATTN_CUDA_BOUNDED_WAIT_MS=$BOUNDED_WAIT_MS step 2-warm-bounded $((LIMIT_WARM - 8)) \
    "${CUDA_TESTS[@]}" --exact warm_the_ptx_cache
  step 2-warm-plain 8 "${CUDA_TESTS[@]}" --exact warm_the_ptx_cache
}

# 3 (and 4): the Hopper smoke test, alone; its failure turns the Hopper path off.
step_smoke() {
  export FLASHATTN_CUDA_BOUNDED_WAIT_MS=$BOUNDED_WAIT_MS
  if ! CUDA_LAUNCH_BLOCKING=1 step 3-hopper-smoke "$LIMIT_SMOKE" "${CUDA_TESTS[@]}" --exact hopper_smoke_test; then
    HOPPER_OFF=1
    export FLASHATTN_CUDA_KERNEL=no-hopper
    echo "hopper smoke test failed: every later step runs with FLASHATTN_CUDA_KERNEL=no-hopper" >>"$out/summary.txt"
  fi
  echo "4 bounded mbarrier waits: ${BOUNDED_WAIT_MS} ms in steps 3, 6 and 7" >>"$out/summary.txt"
}

# 5: the driver's build of the main variants (its JIT forced to run and
# log), as users get them: waits unbounded (an empty bound is none). Loading
# launches nothing, so nothing here can hang.
step_jit() {
  FLASHATTN_CUDA_BOUNDED_WAIT_MS='' CUDA_CACHE_DISABLE=1 step 5-jit "$LIMIT_JIT" "${CUDA_TESTS[@]}" --exact jit_report_of_the_main_variants
}

# The machine's own compute-sanitizer (it matches its driver), else the packed one.
sanitizer() {
  local own
  for own in "$(command -v compute-sanitizer 2>/dev/null)" /usr/local/cuda/bin/compute-sanitizer \
    /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    if [ -n "$own" ] && [ -x "$own" ]; then
      echo "$own"
      return
    fi
  done
  echo "$work/sanitizer/compute-sanitizer"
}

# 6: compute-sanitizer on tiny cases, the tools side by side.
step_sanitize() {
  local san auto=${FLASHATTN_CUDA_KERNEL:-auto}
  san=$(sanitizer)
  local run=(--error-exitcode 1 "$BIN/cuda" --exact tiny_cases_for_the_sanitizer --nocapture)
  FLASHATTN_CUDA_KERNEL=$auto step 6-memcheck "$LIMIT_SANITIZE" "$san" --tool memcheck "${run[@]}" &
  FLASHATTN_CUDA_KERNEL=scalar step 6-memcheck-scalar "$LIMIT_SANITIZE" "$san" --tool memcheck "${run[@]}" &
  FLASHATTN_CUDA_KERNEL=$auto step 6-synccheck "$LIMIT_SANITIZE" "$san" --tool synccheck "${run[@]}" &
  FLASHATTN_CUDA_KERNEL=mma step 6-racecheck-sm80 "$LIMIT_SANITIZE" "$san" --tool racecheck \
    --racecheck-report hazard "${run[@]}" &
  wait
}

# 7: the accuracy tests, one kernel path per process, and the CUDA doctor.
step_accuracy() {
  local paths=(auto scalar mma) p
  [ "${HOPPER_OFF:-0}" = 1 ] && paths=(no-hopper scalar)
  for p in "${paths[@]}"; do
    FLASHATTN_CUDA_KERNEL=$p step "7-accuracy-$p" "$LIMIT_ACCURACY" "${CUDA_TESTS[@]}" --test-threads 4 \
      "${ACCURACY_TESTS[@]}" &
  done
  # A build without the doctor subcommand fails this step (clap names it).
  step 7-doctor-cuda "$LIMIT_ACCURACY" "$BIN/flashattn" doctor --backend cuda --json &
  wait
  unset FLASHATTN_CUDA_BOUNDED_WAIT_MS
}

# `bench NAME LIMIT ARGS...`: bench_paths as step NAME, JSON in
# $out/NAME.json; it starts no shape past 3/5 of the limit, so the largest
# shape in flight still ends within it.
bench() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$BIN/bench_paths" "$@" --max-seconds $((limit * 3 / 5)) \
    --json "$out/${name#*-}.json"
}

# `bench_decode NAME LIMIT ARGS...`: `flashattn bench --decode` as step
# NAME, its table in the log, CSV and JSON in $out/NAME.csv and .json
# (rewritten after every group, so a timeout keeps the groups that ran).
bench_decode() {
  local name=$1 limit=$2
  shift 2
  step "$name" "$limit" "$BIN/flashattn" bench --decode "$@" \
    --csv "$out/${name#*-}.csv" --json "$out/${name#*-}.json"
}

# 8: the CUDA benchmarks (no bounded waits), one after the other.
step_bench() {
  # shellcheck disable=SC2046
  bench 8-bench-cuda-forward "$LIMIT_BENCH_FWD" $(bench_cuda_forward)
  bench 8-bench-cuda-backward "$LIMIT_BENCH_BWD" "${BENCH_CUDA_BACKWARD[@]}"
  bench_decode 8-bench-decode "$LIMIT_DECODE" "${DECODE_DENSE[@]}" "${DECODE_SIZES[@]}"
  bench_decode 8-bench-decode-mla "$LIMIT_DECODE_MLA" "${DECODE_MLA[@]}" "${DECODE_SIZES[@]}"
}

# 9: Vulkan on the same GPU: smoke (doctor, the decode example) and the
# accuracy suites side by side, then the benchmarks.
step_vulkan() {
  export WGPU_BACKEND=vulkan
  local t=$((LIMIT_VULKAN - 35)) s
  step 9-doctor-vulkan "$t" "$BIN/flashattn" doctor --json &
  step 9-decode-vulkan "$t" "$BIN/decode" --backend wgpu --tokens 48 --check-every 8 &
  for s in gpu_forward gpu_backward gpu_decode gpu_kv_quant; do
    step "9-accuracy-$s" "$t" "$BIN/$s" --test-threads 6 &
  done
  wait
  bench 9-bench-vulkan-forward 17 "${BENCH_VULKAN_FORWARD[@]}"
  bench 9-bench-vulkan-backward 18 "${BENCH_VULKAN_BACKWARD[@]}"
}

# 10: the summary, every failure, deadlocks found in any log.
summary() {
  local deadlocks
  deadlocks=$(grep -h 'mbarrier wait timed out' "$out"/*.log 2>/dev/null | sort -u)
  [ -n "$deadlocks" ] && printf 'deadlocks reported:\n%s\n' "$deadlocks" >>"$out/summary.txt"
  rm -rf "$work"
  echo
  cat "$out/summary.txt"
  local failed
  failed=$(grep -cE 'FAILED|TIMEOUT' "$out/summary.txt")
  if [ "$failed" -gt 0 ]; then
    echo "$NAME: $failed step(s) failed; each step's log is $out/<step>.log" | tee -a "$out/summary.txt"
    exit 1
  fi
  echo "$NAME: every step passed" | tee -a "$out/summary.txt"
}

# -------------------------------------------------------------------- dry

dry() {
  set -e
  local start=$SECONDS f
  echo "dry: the scripts parse"
  for f in scripts/*.sh; do bash -n "$f"; done
  if command -v shellcheck >/dev/null; then shellcheck -x scripts/gpu-check.sh scripts/cuda-check.sh scripts/nvrtc.sh; fi
  echo "dry: prepare"
  prepare
  echo "dry: the folder holds what run uses"
  unpack
  for f in "${TEST_BINARIES[@]}" flashattn decode bench_paths; do [ -x "$BIN/$f" ] || die "no $f packed"; done
  local listing
  listing=$(tar -tzf "$DIR/sanitizer.tar.gz")
  [[ $listing == *compute-sanitizer* ]] || die "no compute-sanitizer packed"
  ls "$DIR"/debs/libvulkan1_*.deb >/dev/null || die "no Vulkan loader packed"
  if has_doctor; then echo "dry: flashattn doctor is in this build"; else
    echo "dry: flashattn doctor: missing from this build (run's doctor steps will fail on it)"
  fi
  echo "dry: the benchmarks' arguments (and the torch driver's protocol, on the CPU)"
  # shellcheck disable=SC2046
  "$BIN/bench_paths" --dry-run $(bench_cuda_forward)
  # shellcheck disable=SC2046
  "$BIN/bench_paths" --dry-run $(HOPPER_OFF=1 bench_cuda_forward) >/dev/null
  "$BIN/bench_paths" --dry-run "${BENCH_CUDA_BACKWARD[@]}"
  if [ "$PARTS" = all ]; then
    "$BIN/bench_paths" --dry-run "${BENCH_VULKAN_FORWARD[@]}"
    "$BIN/bench_paths" --dry-run "${BENCH_VULKAN_BACKWARD[@]}"
  fi
  echo "dry: bench --decode's flags, tiny (no device here: the CUDA rows say why)"
  local tiny=(--cache-lens 64 --batches 1 --max-tokens 0) d
  for d in dense mla; do
    if [ $d = dense ]; then set -- "${DECODE_DENSE[@]}"; else set -- "${DECODE_MLA[@]}"; fi
    "$BIN/flashattn" bench --decode "$@" "${tiny[@]}" --csv "$work/decode-$d.csv" >"$work/decode-$d.log"
    grep -q '^cuda .*cannot start' "$work/decode-$d.log" || die "bench --decode ($d): $(cat "$work/decode-$d.log")"
  done
  echo "dry: the Hopper smoke cases and a deadlocked wait under host emulation"
  # Once per test binary and kernel sources (the other script's dry mode
  # finds them passed).
  local stamp=$DOWNLOADS/emulation-passed sum
  sum=$(cat "$BIN/cuda" cuda/*.cu* cuda/emulate/* | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" = "$sum" ]; then
    echo "dry: (passed already on this test binary and these kernel sources)"
  else
    FLASHATTN_CXX=${FLASHATTN_CXX:-g++} FLASHATTN_REQUIRE_NVRTC=1 "${CUDA_TESTS[@]}" --test-threads 2 \
      the_hopper_smoke_cases_pass_under_host_emulation a_deadlocked_mbarrier_wait
    echo "$sum" >"$stamp"
  fi
  echo "dry: run without an NVIDIA driver stops at once with one line"
  if command -v nvidia-smi >/dev/null 2>&1; then
    echo "dry: (not checked: this machine has nvidia-smi)"
  else
    local lines rc=0 t0=$SECONDS
    lines=$(OUT=$work/no-driver "scripts/$NAME.sh" run 2>&1 >/dev/null) || rc=$?
    [ "$rc" = 3 ] && [ "$(printf '%s\n' "$lines" | wc -l)" = 1 ] && [ ! -e "$work/no-driver" ] &&
      [ $((SECONDS - t0)) -le 2 ] || die "run without a driver: exit status $rc, said: $lines"
    echo "dry: $lines (exit status 3, nothing written)"
  fi
  check_size
  rm -rf "$work"
  echo "$NAME: dry mode passed in $((SECONDS - start)) s"
}

case "${1:-}" in
prepare) prepare ;;
run) run ;;
dry) dry ;;
*)
  echo "usage: scripts/$NAME.sh prepare|run|dry" >&2
  exit 2
  ;;
esac
