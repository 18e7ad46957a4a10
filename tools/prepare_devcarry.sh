#!/usr/bin/env bash
# Builds .devcarry/ for the lent H200 within the device tool's 64 MiB carry (tree included), from the repository root:
#   bash tools/prepare_devcarry.sh [src:REV ...]
# 1. ../shared/device/prepare.sh cute native peers (CuTeDSL 4.8.1, the CUTLASS wheel, FLA; cached per machine);
# 2. the cp312 apache-tvm-ffi wheel into .devcarry/extra-tvm-ffi/ (tools/h200_setup.sh unpacks it);
# 3. the CUTLASS wheel replaced by a zip of only the headers cula-sm90 includes (nvcc -M of csrc/probe_kernel.cu,
#    ~0.6 MB instead of 6.4; CMake finds cutlass_library/source/include in it the same way);
# 4. for each src:REV: .devcarry/src-REV/, its pure packages (`git archive` of packages/cula and
#    packages/cula-runtime, ~0.7 MB), for the A/B scripts' --before-src.
# Prints the carry's size and the tree's, and fails when they pass 64,500,000 bytes together (a call with 66.9 MB was
# refused, 64.0 MB went; drop FLA's wheel or a src:REV where it fails and the call needs neither).
set -euo pipefail
for arg in "$@"; do
  [[ "$arg" == src:* ]] || { echo "prepare_devcarry.sh: expected src:REV, got $arg" >&2; exit 2; }
done
CUTE_DSL_VERSION=${CUTE_DSL_VERSION:-4.8.1} bash ../shared/device/prepare.sh cute native peers
PIP=${PIP:-python3 -m pip}
mkdir -p .devcarry/extra-tvm-ffi
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .devcarry/extra-tvm-ffi \
  apache-tvm-ffi==0.1.15.post2
wheel=$(ls .devcarry/nvidia_cutlass-*.whl 2>/dev/null | head -1 || true)
if [ -n "$wheel" ]; then
  work=$(mktemp -d)
  python3 -m zipfile -e "$wheel" "$work"
  include="$work/cutlass_library/source/include"
  nvcc -std=c++17 -arch=sm_90a -M -I packages/cula-sm90/csrc -I "$include" packages/cula-sm90/csrc/probe_kernel.cu \
    | tr ' \\' '\n\n' | grep 'source/include/' | sed 's|.*source/include/|cutlass_library/source/include/|' \
    | sort -u > "$work/headers.txt"
  rm -f .devcarry/cutlass_headers.whl
  (cd "$work" && zip -q "$OLDPWD/.devcarry/cutlass_headers.whl" -@ < headers.txt)
  rm -rf "$work" "$wheel"
fi
for arg in "$@"; do
  rev=${arg#src:}
  rm -rf ".devcarry/src-$rev" && mkdir -p ".devcarry/src-$rev"
  git archive "$rev" packages/cula packages/cula-runtime | tar -x -C ".devcarry/src-$rev"
done
carry=$(du -sb .devcarry | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
echo "carry: $carry bytes; tree: $tree bytes; together $((carry + tree)) of 64500000"
[ $((carry + tree)) -le 64500000 ]
