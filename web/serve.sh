#!/usr/bin/env bash
# Serve the built page (web/build.sh first) on http://127.0.0.1:${PORT:-8000}/.
# Open /?selftest to run every accuracy check on load. WebGPU needs a secure
# context: localhost counts as one.
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -f pkg/flashattn_web.js ]; then
  echo "web/serve.sh: web/pkg is missing; run web/build.sh first" >&2
  exit 1
fi
port=${PORT:-8000}
echo "web/serve.sh: http://127.0.0.1:$port/ (Ctrl-C stops)"
exec python3 -m http.server "$port" --bind 127.0.0.1
