#!/usr/bin/env bash
# The GPU test run on the lent H200 (device tool), from the repository root:
#   source .devcarry/bootstrap.sh && source tools/h200_setup.sh && bash tools/h200_tests.sh [pytest args...]
# Runs the gpu-marked tests (log in $OUT/pytest_gpu.log; per-case errors in $OUT/kda_errors.txt).
set -euo pipefail
export CULA_ERROR_LOG="${OUT:-/tmp}/kda_errors.txt"
python3 -m pytest -q -m gpu -p no:cacheprovider "$@" tests 2>&1 | tee "${OUT:-/tmp}/pytest_gpu.log"
