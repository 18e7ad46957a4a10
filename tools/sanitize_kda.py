"""One kda_prefill or kda_decode call at a named shape, for compute-sanitizer (tools/h200_sanitizer.sh runs it).

    compute-sanitizer --tool memcheck python3 tools/sanitize_kda.py small|gva|large|decode-kimi|...

With ``CULA_BACKEND=cutedsl`` a prefill call runs both CuTeDSL prefill kernels (the intra kernel on the raw inputs,
then the recurrence on its outputs). The ``decode-*`` shapes are cases of ``tests/gpu/test_kda_decode_gpu.py`` (the
decode kernel on any GPU backend: cula-sm90 has none), on a pool of 13 slots: Kimi's softplus gate at H = 32 with two
padding rows (-1, and a slot past the pool), GVA packed lengths 0/1/2/5 on a V-first pool, a bf16 pool with int64
cu_seqlens, and speculative verification (per-token slots, accepted counts); and ``decode-whole-rows``, Kimi's step
over 64 sequences on a pool of 67 slots (128 MiB of state: K-first CTAs of whole rows, 4 line groups behind named
barriers). Each decode call checks the slots no index names unchanged after a synchronisation. The ``cu-mismatch``
shapes are ``small`` with its boundaries passed as ``cu_seqlens_cpu`` (the host tables are built from them) and other
device ``cu_seqlens`` (negative, INT32_MAX, decreasing, INT32_MIN, past T): the prefill kernels' clamps keep every
access inside its tensor (``tests/gpu/test_kda_prefill_cu_seqlens_gpu.py``); ``cu-mismatch-pool`` in the pool form
with a padding row.
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
# the device cu_seqlens of the cu-mismatch shapes (the host's: SHAPES["small"].cu), and whether in the pool form
MISMATCH_CU = (-4096, 2**31 - 1, 64, -(2**31), 65, 200 + 4096)
MISMATCH_SHAPES = {"cu-mismatch": False, "cu-mismatch-pool": True}
# the decode shapes: names of tests/gpu/test_kda_decode_gpu.py's cases
DECODE_SHAPES = {
    "decode-kimi": "kimi-H32-N4-T1",
    "decode-gva-vfirst": "gva-H2-HV8-packed-0-1-2-5-vfirst",
    "decode-bf16": "bf16-pool-H4-packed-cu64",
    "decode-spec": "spec-verify-H4-packed",
    "decode-whole-rows": "kimi-H32-N64-T1-whole-rows",  # 128 MiB of state: K-first CTAs of 4 lines
}


def run_decode(shape: str) -> str:
    from cula.kda import kda_decode
    from tests.gpu.test_kda_decode_gpu import CASES, make_call

    case = next(c for c in CASES if c.name == DECODE_SHAPES[shape])
    call = make_call(case)
    before = call["state"].clone()
    o = kda_decode(**call)
    torch.cuda.synchronize()
    idx = call["state_indices"].flatten()
    named = {int(s) for s in idx.tolist() if 0 <= s < before.shape[0]}
    untouched = [s for s in range(before.shape[0]) if s not in named]
    assert torch.equal(call["state"][untouched], before[untouched]), "a slot no index names changed"
    assert torch.isfinite(o).all() and torch.isfinite(call["state"]).all()
    return f"o {tuple(o.shape)}"


def run_mismatch(shape: str) -> str:
    from cula.kda import kda_prefill

    case = SHAPES["small"]
    kwargs = make_inputs(case, "cuda")
    kwargs["cu_seqlens_cpu"] = kwargs["cu_seqlens"].cpu()
    kwargs["cu_seqlens"] = torch.tensor(MISMATCH_CU, dtype=torch.int32, device="cuda")
    if MISMATCH_SHAPES[shape]:  # sequence 1 a padding row: its o rows zeroed by the recurrence
        del kwargs["initial_state"]
        kwargs["output_final_state"] = False
        kwargs["state"] = torch.zeros(7, case.HV, 128, 128, device="cuda")
        kwargs["state_indices"] = torch.tensor((0, -1, 1, 2, 3), dtype=torch.int32, device="cuda")
    o, _ = kda_prefill(**kwargs)
    torch.cuda.synchronize()  # (o is wrong for such boundaries: only the accesses are checked)
    return f"o {tuple(o.shape)}"


if __name__ == "__main__":
    from cula.kda import kda_prefill

    if sys.argv[1] in DECODE_SHAPES:
        print(f"{sys.argv[1]}: ok, {run_decode(sys.argv[1])}")
        sys.exit(0)
    if sys.argv[1] in MISMATCH_SHAPES:
        print(f"{sys.argv[1]}: ok, {run_mismatch(sys.argv[1])}")
        sys.exit(0)
    kwargs = make_inputs(SHAPES[sys.argv[1]], "cuda")
    o, ht = kda_prefill(**kwargs)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    print(f"{sys.argv[1]}: ok, o {tuple(o.shape)}")
