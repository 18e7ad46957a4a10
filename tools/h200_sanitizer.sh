#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck on kda_prefill at three shapes, on the lent H200:
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && CULA_BACKEND=sm90 bash tools/h200_sanitizer.sh
# Output in $OUT/sanitizer_<backend>_<tool>_<shape>.log; a summary line per run on stdout.
# SANITIZER_TOOLS picks the tools (default: memcheck racecheck), SANITIZER_SHAPES the shapes of tools/sanitize_kda.py
# (default: small gva large; the unbounded gate's: small-kimi gva-extreme large-kimi; device cu_seqlens unlike the host
# tables: cu-mismatch cu-mismatch-pool). API errors are not reported: cuda-python (which
# CuTeDSL loads) probes driver entry points with cuGetProcAddress, and each probe of a symbol this driver lacks is an
# API error (CUDA_ERROR_INVALID_VALUE) that the sanitizer would count; memory-access errors are still all reported.
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
for tool in ${SANITIZER_TOOLS:-memcheck racecheck}; do
  for shape in ${SANITIZER_SHAPES:-small gva large}; do
    log="$OUT/sanitizer_${CULA_BACKEND:-auto}_${tool}_${shape}.log"
    compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 99 python3 tools/sanitize_kda.py "$shape" > "$log" 2>&1
    echo "${CULA_BACKEND:-auto} $tool $shape: exit $? | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
  done
done
