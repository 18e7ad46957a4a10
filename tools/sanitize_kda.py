"""One kda_prefill call at a named shape, for compute-sanitizer (tools/h200_sanitizer.sh runs it).

    compute-sanitizer --tool memcheck python3 tools/sanitize_kda.py small|gva|large

With ``CULA_BACKEND=cutedsl`` the call runs both CuTeDSL kernels (the intra kernel on the raw inputs, then the
recurrence on its outputs), which are every CuTeDSL kernel cuLA ships.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.kda_cases import KdaCase, make_inputs  # noqa: E402

SHAPES = {
    "small": KdaCase("sanitize-small-varlen", B=1, T=200, H=2, HV=2, cu=(0, 1, 64, 65, 65, 200)),
    "gva": KdaCase("sanitize-gva", B=2, T=300, H=2, HV=8, state_v_first=True),
    "large": KdaCase("sanitize-large", B=2, T=4096, H=8, HV=8),
    # the unbounded gate's forms (issue 25): the in-kernel softplus, an extreme precomputed gate, Kimi's fp32 gate
    "small-kimi": KdaCase("sanitize-small-kimi", B=1, T=200, H=2, HV=2, cu=(0, 1, 64, 65, 65, 200), gate="kimi"),
    "gva-extreme": KdaCase("sanitize-gva-extreme", B=2, T=300, H=2, HV=8, state_v_first=True, gate="extreme",
                           gate_in_kernel=False),
    "large-kimi": KdaCase("sanitize-large-kimi", B=2, T=4096, H=8, HV=8, gate="kimi", gate_in_kernel=False),
}


if __name__ == "__main__":
    from cula.kda import kda_prefill

    kwargs = make_inputs(SHAPES[sys.argv[1]], "cuda")
    o, ht = kda_prefill(**kwargs)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    print(f"{sys.argv[1]}: ok, o {tuple(o.shape)}")
