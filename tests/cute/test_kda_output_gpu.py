"""The CuTeDSL chunk-output kernel (``chunk_kda_fwd_o``) on a GPU, with the delta-h primitive (``chunk_kda_fwd_h``)
feeding it: the modular pair reproduces the fused recurrence's o bit for bit, and o matches FLA's modular output
primitive in fp32 (rel-L2 < 1e-2) with the upper triangle of Aqk NaN (the kernel must mask it) and the allocator
NaN-poisoned (every element must be written). Inputs and cases: tests/cute/test_kda_recurrence_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.reference.kda_chunked import kda_fwd_o
from tests.cute.test_kda_recurrence_gpu import BOUND, CASES, C, Case, _poison_allocator, _run, make_inputs
from tests.helpers import rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not cula_cute.is_available(), reason='CuTeDSL or TVM-FFI is missing (pip install "cula-runtime[cute]")'
    ),
]

K = 128
PICKED = [c for c in CASES if c.name in ("B2-T200-HV4-kv-h0", "B1-T63-HV2-vk-noh0", "B3-T128-HV2-vk-h0",
                                         "varlen-0-100-100-228-HV4-kv-h0", "varlen-0-1-64-65-300-HV2-vk-noh0")]


def _modular(args: dict, block_v: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(o, h, v_new)`` of chunk_kda_fwd_h followed by chunk_kda_fwd_o."""
    from cula_runtime.cute.kda.output import chunk_kda_fwd_o
    from cula_runtime.cute.kda.recurrence import chunk_kda_fwd_h

    h, v_new, _ = chunk_kda_fwd_h(
        args["kg"], args["w"], args["u"], args["gk"], initial_state=args["initial_state"],
        cu_seqlens=args["cu_seqlens"], state_v_first=args["state_v_first"], block_v=block_v,
    )  # fmt: skip
    return chunk_kda_fwd_o(args["qg"], v_new, args["Aqk"], h, args["scale"], cu_seqlens=args["cu_seqlens"],
                           state_v_first=args["state_v_first"], block_v=block_v), h, v_new


@pytest.mark.parametrize("case", PICKED, ids=[c.name for c in PICKED])
def test_modular_pair_gives_the_fused_bits_and_matches_the_reference(case: Case) -> None:
    args = make_inputs(case, seed=2, device="cuda")
    _poison_allocator(8 * case.B * case.T * case.HV * K * 2)
    o, h, v_new = _modular(args)
    torch.cuda.synchronize()
    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all(), "o has unwritten or non-finite entries"
    o_fused, _ = _run(args)
    assert torch.equal(o, o_fused), "the modular pair must reproduce the fused kernel's o exactly"
    f32 = {name: (t.cpu().float() if isinstance(t, torch.Tensor) else t) for name, t in args.items()}
    cu = args["cu_seqlens"].cpu() if args["cu_seqlens"] is not None else None
    aqk = torch.nan_to_num(f32["Aqk"], nan=0.0)
    o_ref = kda_fwd_o(f32["qg"], v_new.cpu().float(), torch.zeros_like(f32["gk"]), aqk, h.cpu().float(),
                      args["scale"], C, cu, args["state_v_first"])
    assert rel_l2(o.cpu(), o_ref) < BOUND


@pytest.mark.parametrize("block_v", [32, 128])
def test_every_block_v_gives_the_same_bits(block_v: int) -> None:
    case = next(c for c in CASES if c.name == "varlen-0-15-100-300-1200-HV2-kv-noh0")
    args = make_inputs(case, seed=8, device="cuda")
    o64, h64, _ = _modular(args, block_v=64)
    o, h, _ = _modular(args, block_v=block_v)
    assert torch.equal(h, h64) and torch.equal(o, o64)


def test_bad_h_shape_is_refused_before_launch() -> None:
    from cula_runtime.cute.kda.output import chunk_kda_fwd_o

    case = next(c for c in CASES if c.name == "B2-T200-HV4-kv-h0")
    args = make_inputs(case, seed=1, device="cuda")
    h = torch.zeros(2, 3, 4, K, K, dtype=torch.bfloat16, device="cuda")  # T=200 needs 4 chunks per row
    with pytest.raises(ValueError, match=r"h must be bfloat16 \(2, 4, 4, 128, 128\)"):
        chunk_kda_fwd_o(args["qg"], args["u"], args["Aqk"], h, args["scale"])
