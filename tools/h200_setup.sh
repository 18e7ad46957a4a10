# Source on the lent H200, after .devcarry/bootstrap.sh: builds cula-sm90 for that machine's Python into
# /tmp/cula-site and puts it and the pure packages' sources on PYTHONPATH.
# CuTeDSL launches through TVM-FFI: its wheel for the device's Python, when prepare.sh did not pack it.
for _w in .devcarry/extra-tvm-ffi/*.whl; do [ -e "$_w" ] && python3 -m zipfile -e "$_w" "${DEVSITE:-/tmp/devsite}"; done
# (a fresh target each call: pip --target keeps an existing package directory, so a warm machine would otherwise
# keep the previous call's build of the extension)
rm -rf /tmp/cula-site
# CULA_SM90_ABLATION=1 also builds the intra kernel's timing-only ablation forms (CULA_SM90_INTRA_TUNED=ablate:*)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/cula-site \
  ${CULA_SM90_ABLATION:+--config-settings=cmake.define.CULA_SM90_ABLATION=ON} ./packages/cula-sm90 2>&1 | tail -3
export PYTHONPATH="/tmp/cula-site:$PWD/packages/cula-runtime/src:$PWD/packages/cula/src:$PWD:${PYTHONPATH:-}"
export OUT=${OUT:-/tmp/cula-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
