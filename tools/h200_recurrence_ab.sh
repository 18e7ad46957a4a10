#!/usr/bin/env bash
# A/B/A/B builds of the recurrence kernel on the lent H200, in one device call, from the repository root:
#   source .devcarry/bootstrap.sh && bash tools/h200_recurrence_ab.sh "old new old new"
# Each name NAME has .devcarry/variants/NAME_rec.cu and NAME_ptx.cuh (full copies of csrc/kda/kda_recurrence.cu and
# csrc/kda/ptx.cuh), and optionally NAME_params.h (of csrc/kda/kda_params.h; without it the tree's own); they are
# copied over those files, the extension rebuilt (tools/h200_setup.sh, incremental), the outputs hashed
# (tools/hash_sm90_outputs.py: bit-identity across builds) and the stages profiled (benchmarks/profile_kda.py,
# CULA_SM90_PDL=0, BV 64 and 128) on PROFILE_CONFIGS. (A variant must have the tree's launcher interface,
# launch_kda_recurrence(params, block_v, stream) of kda_params.h: those written from commits before issue 25's
# retirement of the mma.sync forms at 64/128 and the 3-stage kernel do not build.) Results:
# $OUT/hashes.txt and $OUT/profile_recurrence.txt, each block headed "=== variant NAME". PROFILE_BLOCK_V (default
# "64,128") picks the V blocks profiled; HASH=0 skips the hashes (timing-only variants, whose outputs are garbage).
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
CONFIGS=${PROFILE_CONFIGS:-varlen T4096 20xuniform,varlen T8192 20xuniform,varlen T16384 20xuniform,fixed B1 T16384,fixed B2 T16384}
PARAMS=packages/cula-sm90/csrc/kda/kda_params.h
cp "$PARAMS" /tmp/kda_params_tree.h
for v in $1; do
  cp ".devcarry/variants/${v}_rec.cu" packages/cula-sm90/csrc/kda/kda_recurrence.cu
  cp ".devcarry/variants/${v}_ptx.cuh" packages/cula-sm90/csrc/kda/ptx.cuh
  if [ -e ".devcarry/variants/${v}_params.h" ]; then cp ".devcarry/variants/${v}_params.h" "$PARAMS"
  else cp /tmp/kda_params_tree.h "$PARAMS"; fi
  source tools/h200_setup.sh > "$OUT/setup_$v.log" 2>&1
  echo "=== variant $v $(date -u +%T)" | tee -a "$OUT/profile_recurrence.txt" "$OUT/hashes.txt"
  if [ "${HASH:-1}" != 0 ]; then
    python3 tools/hash_sm90_outputs.py "$v" --forms tensor 2>&1 | grep HASH | tee -a "$OUT/hashes.txt"
  fi
  CULA_SM90_PDL=0 python3 benchmarks/profile_kda.py --backend sm90 --block-v "${PROFILE_BLOCK_V:-64,128}" --reps 10 \
    --configs "$CONFIGS" 2>&1 | grep -v -i warn | tee -a "$OUT/profile_recurrence.txt"
done
