#!/usr/bin/env bash
# Runs correctness-only steps of tools/h200_session.sh side by side on the lent H200: each argument is one lane, a
# space-separated list of steps run in turn, optionally after VAR=value settings for that lane alone; the lanes run at once (the GPU and the host's 16 cores are shared, so
# never put a timed step in a lane). Each lane's output goes to $OUT/lane<i>.log; one line per lane at the end.
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_lanes.sh "tests:doors-ops" \
#     "fla fla:lightning" "SANITIZER_BACKENDS=cutedsl sanitizer:unbounded"
set -uo pipefail
OUT=${OUT:-/tmp/cula-out}
pids=()
i=0
for lane in "$@"; do
  i=$((i + 1))
  settings=() steps=()
  for word in $lane; do
    if [[ "$word" == *=* ]]; then settings+=("$word"); else steps+=("$word"); fi
  done
  env "${settings[@]}" bash tools/h200_session.sh "${steps[@]}" > "$OUT/lane$i.log" 2>&1 &
  pids+=($!)
done
i=0
for pid in "${pids[@]}"; do
  i=$((i + 1))
  wait "$pid"
  echo "lane $i (${!i}): exit $? | $(grep -c '^=== .*: exit 0' "$OUT/lane$i.log") step(s) exit 0"
done
