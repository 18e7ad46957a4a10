#!/usr/bin/env bash
# Nsight Compute on one kda_prefill call per backend, on the lent H200 (the Firecracker machines read the counters):
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_ncu.sh ["fixed B1 T16384"]
# For sm90, then for the CuTeDSL backend (NCU_CUTEDSL=0 leaves it out): throughput, occupancy, warp stall reasons
# (also per source line, from SourceCounters) and memory traffic of every kernel of the call, as text in
# $OUT/ncu_<backend>.txt.
# NCU_SM90_KNOBS="CULA_SM90_INTRA_TUNED=bands CULA_SM90_PDL=0" also profiles sm90 with those settings
# ($OUT/ncu_sm90_knobs.txt). NCU_SOURCE_KERNEL=intra|recurrence (NCU_INTRA_SOURCE=1: intra) instead first profiles
# only that sm90 kernel for where its warps stall: every stall reason (--print-details all,
# $OUT/ncu_sm90_<kernel>_stalls.txt) and per SASS instruction (--page source --csv, $OUT/ncu_sm90_<kernel>_source.csv;
# `python tools/ncu_segments.py FILE.csv` sums it per barrier-delimited segment); with NCU_CUTEDSL=0 and no
# NCU_SM90_KNOBS, nothing else.
# Clocks are left alone (--clock-control none), as the device notes ask.
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
config=${1:-fixed B1 T16384}
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis
          --section SourceCounters)
run() {  # backend, output file
  timeout 200 ncu --clock-control none --profile-from-start off "${sections[@]}" \
    python3 tools/ncu_kda.py --backend "$1" --config "$config" > "$2" 2>&1
  echo "ncu $1 ($config): exit $? | $(grep -c '^  [A-Za-z_].*(' "$2") kernel reports"
}
source_kernel=${NCU_SOURCE_KERNEL:-}
[[ ${NCU_INTRA_SOURCE:-0} == 1 ]] && source_kernel=intra
if [[ -n $source_kernel ]]; then
  opts=(--clock-control none --profile-from-start off -k "regex:kda_$source_kernel" --section WarpStateStats
        --section SourceCounters)
  stem="$OUT/ncu_sm90_$source_kernel"
  timeout 200 ncu "${opts[@]}" --print-details all python3 tools/ncu_kda.py --backend sm90 --config "$config" \
    > "${stem}_stalls.txt" 2>&1
  echo "ncu sm90 $source_kernel stalls ($config): exit $?"
  timeout 200 ncu "${opts[@]}" --page source --csv --print-source sass python3 tools/ncu_kda.py --backend sm90 \
    --config "$config" > "${stem}_source.csv" 2>&1
  echo "ncu sm90 $source_kernel per-instruction ($config): exit $? | $(wc -l < "${stem}_source.csv") lines"
else
  run sm90 "$OUT/ncu_sm90.txt"
fi
if [[ -n ${NCU_SM90_KNOBS:-} ]]; then  # sm90 once more with these knobs, e.g. another intra form or V block
  (export $NCU_SM90_KNOBS; run sm90 "$OUT/ncu_sm90_knobs.txt")
fi
if [[ ${NCU_CUTEDSL:-1} != 0 ]]; then
  run cutedsl "$OUT/ncu_cutedsl.txt"
fi
