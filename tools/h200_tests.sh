#!/usr/bin/env bash
# The GPU test run on the lent H200 (device tool), from the repository root:
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_tests.sh [pytest args and paths]
# Runs the gpu-marked tests under the given paths (default: tests/). Log in $OUT/pytest_gpu<GPU_LOG_TAG>.log;
# per-case errors appended to $OUT/kda_errors.txt. One line per test (-q dropped), so a run its step's timeout cuts
# still says which tests passed.
set -euo pipefail
export CULA_ERROR_LOG="${OUT:-/tmp}/kda_errors.txt"
args=()
has_path=0
for arg in "$@"; do
  [[ "$arg" == tests* ]] && has_path=1
  [ "$arg" = -q ] || args+=("$arg")
done
[ "$has_path" = 1 ] || args+=(tests)
python3 -m pytest -v -m gpu -p no:cacheprovider "${args[@]}" 2>&1 | tee "${OUT:-/tmp}/pytest_gpu${GPU_LOG_TAG:-}.log"
