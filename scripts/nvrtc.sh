# Sourced by scripts/gpu-check.sh and scripts/cuda-check.sh (after they cd to
# the repository root and set $out).
# cudarc looks for libnvrtc.so or libnvrtc.so.12; a CUDA 13 machine may
# have only libnvrtc.so.13 (the toolkit's, or PyTorch's wheel): link the
# first one found as libnvrtc.so in a folder put on LD_LIBRARY_PATH.
find_nvrtc() {
  local lib
  lib=$( { ldconfig -p 2>/dev/null | grep -o '/[^ ]*libnvrtc\.so[.0-9]*$'
    ls /usr/local/cuda*/lib64/libnvrtc.so* /usr/local/cuda*/targets/*/lib/libnvrtc.so* 2>/dev/null
    timeout 60 find / -xdev -path '*/nvidia/*' -name 'libnvrtc.so*' 2>/dev/null; } | grep -v builtins | head -n 1)
  [ -n "$lib" ] || return 0
  mkdir -p /tmp/nvrtc && ln -sf "$lib" /tmp/nvrtc/libnvrtc.so
  export LD_LIBRARY_PATH="/tmp/nvrtc:$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "nvrtc: $lib" >>"$out/machine.txt"
}
