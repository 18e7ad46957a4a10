#!/usr/bin/env bash
# Nsight Compute on one kda_prefill call per backend, on the lent H200 (the Firecracker machines read the counters):
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_ncu.sh ["fixed B1 T16384"]
# For sm90, then for the CuTeDSL backend once per intra variant in NCU_INTRA (default: its default variant
# fused-prepare-prefetch-8warps, and lean-unrolled): throughput, occupancy, warp stall reasons (also per source line,
# from SourceCounters) and memory traffic of every kernel of the call, as text in $OUT/ncu_<backend>[_<variant>].txt.
# NCU_SM90_KNOBS="CULA_SM90_INTRA_PERSISTENT=1 CULA_SM90_RECURRENCE_WGMMA=0" also profiles sm90 with those settings
# ($OUT/ncu_sm90_knobs.txt). NCU_INTRA_SOURCE=1 first profiles only the sm90 intra kernel for where its warps stall:
# every stall reason (--print-details all, $OUT/ncu_sm90_intra_stalls.txt) and per SASS instruction
# (--page source --csv, $OUT/ncu_sm90_intra_source.csv); with NCU_INTRA=" " and no NCU_SM90_KNOBS, nothing else.
# Clocks are left alone (--clock-control none), as the device notes ask.
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
config=${1:-fixed B1 T16384}
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section SourceCounters)
run() {  # backend, output file, then the environment's CULA_CUTE_INTRA
  timeout 200 ncu --clock-control none --profile-from-start off "${sections[@]}" \
    python3 tools/ncu_kda.py --backend "$1" --config "$config" > "$2" 2>&1
  echo "ncu $1 ${CULA_CUTE_INTRA:-} ($config): exit $? | $(grep -c '^  [A-Za-z_].*(' "$2") kernel reports"
}
if [[ ${NCU_INTRA_SOURCE:-0} == 1 ]]; then
  intra=(--clock-control none --profile-from-start off -k regex:kda_intra --section WarpStateStats
         --section SourceCounters)
  timeout 200 ncu "${intra[@]}" --print-details all python3 tools/ncu_kda.py --backend sm90 --config "$config" \
    > "$OUT/ncu_sm90_intra_stalls.txt" 2>&1
  echo "ncu sm90 intra stalls ($config): exit $?"
  timeout 200 ncu "${intra[@]}" --page source --csv --print-source sass python3 tools/ncu_kda.py --backend sm90 \
    --config "$config" > "$OUT/ncu_sm90_intra_source.csv" 2>&1
  echo "ncu sm90 intra per-instruction ($config): exit $? | $(wc -l < "$OUT/ncu_sm90_intra_source.csv") lines"
else
  run sm90 "$OUT/ncu_sm90.txt"
fi
if [[ -n ${NCU_SM90_KNOBS:-} ]]; then  # sm90 once more with these knobs, e.g. the persistent intra kernel
  (export $NCU_SM90_KNOBS; run sm90 "$OUT/ncu_sm90_knobs.txt")
fi
for variant in ${NCU_INTRA:-fused-prepare-prefetch-8warps lean-unrolled}; do
  CULA_CUTE_INTRA=$variant run cutedsl "$OUT/ncu_cutedsl_$variant.txt"
done
