#!/usr/bin/env bash
# Nsight Compute on one kda_prefill call per backend, on the lent H200 (the Firecracker machines read the counters):
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_ncu.sh ["fixed B1 T16384"]
# For each GPU backend (the CuTeDSL one with the intra variant in NCU_INTRA, default fused-prepare): throughput,
# occupancy, warp stall reasons and memory traffic of every kernel of the call, as text in $OUT/ncu_<backend>.txt.
# Clocks are left alone (--clock-control none), as the device notes ask.
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
config=${1:-fixed B1 T16384}
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis)
for backend in sm90 cutedsl; do
  CULA_CUTE_INTRA=${NCU_INTRA:-fused-prepare} timeout 280 ncu --clock-control none --profile-from-start off \
    "${sections[@]}" python3 tools/ncu_kda.py --backend "$backend" --config "$config" > "$OUT/ncu_$backend.txt" 2>&1
  echo "ncu $backend ($config): exit $? | $(grep -c '^  [A-Za-z_].*(' "$OUT/ncu_$backend.txt") kernel reports"
done
