# Sourced by scripts/test.sh and scripts/test-web.sh: `step NAME COMMAND...`
# runs the command and notes its seconds; `print_steps` lists them.
steps=()
step() {
  local name=$1 t0
  shift
  t0=$(date +%s)
  "$@"
  steps+=("$(printf '%5d s  %s' $(( $(date +%s) - t0 )) "$name")")
}
print_steps() {
  if [ ${#steps[@]} -gt 0 ]; then printf '%s\n' "${steps[@]}"; fi
}
