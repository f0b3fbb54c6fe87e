# Sourced by scripts/gpu-check.sh's `run` (after it sets $work and $out).
# cudarc looks for libnvrtc.so, libnvrtc.so.12 and older: a CUDA 13 machine
# may have only libnvrtc.so.13 (the toolkit's, or PyTorch's wheel). The first
# one found is linked as libnvrtc.so into $work/nvrtc, put first on
# LD_LIBRARY_PATH, and named in machine.txt (step 1's test prints its version).
find_nvrtc() {
  local lib
  lib=$( {
    ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnvrtc\.so[.0-9]*$'
    ls /usr/local/cuda*/lib64/libnvrtc.so* /usr/local/cuda*/targets/*/lib/libnvrtc.so* 2>/dev/null
    timeout 20 find / -xdev -path '*/nvidia/*' -name 'libnvrtc.so*' 2>/dev/null
  } | grep -v builtins | head -n 1)
  if [ -z "$lib" ]; then
    echo "nvrtc: none found (the CUDA steps will fail: install CUDA's NVRTC)" >>"$out/machine.txt"
    return 0
  fi
  mkdir -p "$work/nvrtc" && ln -sf "$lib" "$work/nvrtc/libnvrtc.so"
  export LD_LIBRARY_PATH="$work/nvrtc:$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "nvrtc: $lib" >>"$out/machine.txt"
}
