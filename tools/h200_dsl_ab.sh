#!/usr/bin/env bash
# CuTeDSL version A/B on the lent H200: the cutedsl backend's benchmark (bench_kda_prefill.py, FLA and sm90 left out)
# under two CuTeDSL builds in turn, new / old / new, in one device call, so that a speed change from the DSL is told
# apart from the machine's drift. From the repository root:
#   bash tools/h200_dsl_ab.sh            (carry [".devcarry-old"])
# - the new DSL: the one a previous call's `source .devcarry/bootstrap.sh` unpacked into /tmp/devsite (the machine
#   must still be warm; the script stops if it is not);
# - the old DSL: .devcarry-old/, made here with `CUTE_DSL_VERSION=4.6.2 bash ../shared/device/prepare.sh cute` in a
#   scratch checkout, its cutedsl.tar.xz and the cp312 apache-tvm-ffi wheel copied in; unpacked into /tmp/devsite-old.
# Writes $OUT/dsl_<new|old>_<round>.md (each with the CuTeDSL version in its header). DSL_AB_ORDER="old:2 new:3 old:3"
# runs another order; DSL_AB_REPS sets the timings per config (default 50).
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
mkdir -p "$OUT"
new=/tmp/devsite
old=/tmp/devsite-old
if [ ! -f "$new/.cutedsl-unpacked" ]; then
  echo "h200_dsl_ab: $new holds no CuTeDSL (the machine went cold since the call that unpacked it)" >&2
  exit 2
fi
if [ ! -f "$old/.unpacked" ]; then
  mkdir -p "$old"
  xz -T0 -dc .devcarry-old/cutedsl.tar.xz | tar -xf - -C "$old" || exit 2
  for wheel in .devcarry-old/*.whl; do python3 -m zipfile -e "$wheel" "$old"; done
  touch "$old/.unpacked"
fi
src="$PWD/packages/cula-runtime/src:$PWD/packages/cula/src:$PWD"
for run in ${DSL_AB_ORDER:-new:1 old:1 new:2}; do
  which=${run%%:*}
  site=$new
  [ "$which" = old ] && site=$old
  echo "=== CuTeDSL $which, round ${run##*:} ($(date -u +%H:%M:%S))"
  PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages:$src" timeout 280 python3 benchmarks/bench_kda_prefill.py \
    --skip fla,cula-sm90 --reps "${DSL_AB_REPS:-50}" --out "$OUT/dsl_${which}_${run##*:}.md"
  echo "=== exit $?"
done
