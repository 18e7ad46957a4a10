#!/usr/bin/env bash
# A/B/A/B builds of the intra kernel's per-item code on the lent H200, in one device call, from the repository root:
#   source .devcarry/bootstrap.sh && bash tools/h200_intra_ab.sh "base variant base variant"
# Each name is a header .devcarry/variants/NAME.cuh (a full copy of csrc/kda/kda_intra_item.cuh: put the committed
# one there as base.cuh); it is copied over kda_intra_item.cuh, the extension rebuilt (tools/h200_setup.sh,
# incremental: ~10 s), the outputs hashed (tools/hash_sm90_outputs.py; bit-identity across builds) and the intra forms
# FORMS (default "tensor bands") profiled on PROFILE_CONFIGS with CULA_SM90_PDL=0 (profile:tuned, BV 64). Results:
# $OUT/hashes.txt and $OUT/profile_kda_tuned.txt, each block headed "=== variant NAME".
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
export PROFILE_CONFIGS=${PROFILE_CONFIGS:-fixed B1 T16384,varlen T16384 10xuniform,varlen T4096 20xuniform}
for v in $1; do
  cp ".devcarry/variants/$v.cuh" packages/cula-sm90/csrc/kda/kda_intra_item.cuh
  source tools/h200_setup.sh > "$OUT/setup_$v.log" 2>&1
  echo "=== variant $v $(date -u +%T)" | tee -a "$OUT/profile_kda_tuned.txt" "$OUT/hashes.txt"
  python3 tools/hash_sm90_outputs.py "$v" 2>&1 | grep HASH | tee -a "$OUT/hashes.txt"
  CULA_SM90_PDL=0 TUNED_FORMS="${FORMS:-tensor bands}" bash tools/h200_session.sh profile:tuned > /dev/null 2>&1
done
