#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on kda_prefill at three shapes, on the lent H200:
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && CULA_BACKEND=sm90 bash tools/h200_sanitizer.sh
# Output in $OUT/sanitizer_<backend>_<tool>_<shape>.log; a summary line per run on stdout.
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
for tool in memcheck racecheck; do
  for shape in small gva large; do
    log="$OUT/sanitizer_${CULA_BACKEND:-auto}_${tool}_${shape}.log"
    compute-sanitizer --tool "$tool" --error-exitcode 99 python3 tools/sanitize_kda.py "$shape" > "$log" 2>&1
    echo "${CULA_BACKEND:-auto} $tool $shape: exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  done
done
