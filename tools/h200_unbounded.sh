#!/usr/bin/env bash
# The unbounded gate on the lent H200 (issue 25), in one device call:
#   bash tools/h200_unbounded.sh        (carry [".devcarry"]; outputs under $OUT)
# Concurrently (no timings): FLA's errors on the cases tests/kda_fla_errors.py lacks, the CuTeDSL and sm90 GPU tests
# of every unbounded gate form, compute-sanitizer on the sm90 unbounded form; then, on a quiet GPU, the Kimi-shape
# benchmark (benchmarks/bench_kda_unbounded.py) with the time left (UNB_BENCH_ONLY picks its rows).
source .devcarry/bootstrap.sh && source tools/h200_setup.sh > "$OUT/setup.log" 2>&1
export CULA_ERROR_LOG=$OUT/kda_errors.txt
UNBOUNDED="kimi or extreme or slow or wide or unbounded or softplus or replays"
( timeout 400 python3 benchmarks/fla_error_bounds.py "$OUT/kda_fla_errors.py" missing > "$OUT/fla.log" 2>&1 ) &
( timeout 380 python3 -m pytest -q -m gpu -p no:cacheprovider tests/cute/test_kda_intra_gpu.py tests/gpu \
    -k "cutedsl and ($UNBOUNDED)" > "$OUT/pytest_cutedsl_unb.log" 2>&1 ) &
( timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu -k "sm90 and ($UNBOUNDED)" \
    > "$OUT/pytest_sm90_unb.log" 2>&1
  CULA_BACKEND=sm90 SANITIZER_SHAPES="small-kimi gva-extreme large-kimi" timeout 200 bash tools/h200_sanitizer.sh \
    > "$OUT/sanitizer_sm90_unb.txt" 2>&1 ) &
wait
tail -3 "$OUT/pytest_sm90_unb.log" "$OUT/pytest_cutedsl_unb.log"; cat "$OUT/sanitizer_sm90_unb.txt" "$OUT/fla.log"
left=$(( ${UNB_DEADLINE_S:-570} - SECONDS )); echo "bench: ${left}s left"
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 benchmarks/bench_kda_unbounded.py --only "${UNB_BENCH_ONLY:-}" --reps 20 --rounds 2 \
    --out "$OUT/kda_unbounded_h200.md" > "$OUT/bench_unb.log" 2>&1
  tail -20 "$OUT/bench_unb.log"
fi
