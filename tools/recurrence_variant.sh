#!/usr/bin/env bash
# Write a recurrence variant for tools/h200_recurrence_ab.sh from a commit, on the local checkout (before the device
# call; the device's copy has no git history):
#   bash tools/recurrence_variant.sh NAME REV
# writes .devcarry/variants/NAME_rec.cu, NAME_ptx.cuh and NAME_params.h from REV's csrc/kda/kda_recurrence.cu, ptx.cuh
# and kda_params.h (REV = HEAD for the tree's own kernel, e.g. "cur").
set -euo pipefail
name=$1
rev=$2
src=packages/cula-sm90/csrc/kda
out=.devcarry/variants
mkdir -p "$out"
git show "$rev:$src/kda_recurrence.cu" > "$out/${name}_rec.cu"
git show "$rev:$src/ptx.cuh" > "$out/${name}_ptx.cuh"
git show "$rev:$src/kda_params.h" > "$out/${name}_params.h"
echo "$out/${name}_{rec.cu,ptx.cuh,params.h} from $(git rev-parse --short "$rev")"
