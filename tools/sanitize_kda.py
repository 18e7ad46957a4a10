"""One kda_prefill call at a named shape, for compute-sanitizer (tools/h200_sanitizer.sh runs it).

    compute-sanitizer --tool memcheck python3 tools/sanitize_kda.py small|gva|large

With ``CULA_BACKEND=cutedsl`` it also runs the CuTeDSL modular primitives on the same inputs (scores, solve_tril,
recompute_w_u, the delta-h primitive and the chunk output) and the other pipeline: ``lean-unrolled`` (kda_prepare
-> intra -> recurrence) after the default ``fused-prepare-prefetch-8warps`` (the intra kernel doing kda_prepare's
work, the recurrence on its per-chunk decay rows), or that after any non-fused ``CULA_CUTE_INTRA``, so every
shipped CuTeDSL kernel is checked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.kda_cases import KdaCase, make_inputs  # noqa: E402

SHAPES = {
    "small": KdaCase("sanitize-small-varlen", B=1, T=200, H=2, HV=2, cu=(0, 1, 64, 65, 65, 200)),
    "gva": KdaCase("sanitize-gva", B=2, T=300, H=2, HV=8, state_v_first=True),
    "large": KdaCase("sanitize-large", B=2, T=4096, H=8, HV=8),
}


def modular_primitives(kwargs: dict) -> None:
    """The CuTeDSL modular path on ``kwargs`` (a kda_prefill call): every kernel not in the fused pipeline."""
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_scores, chunk_kda_recompute_w_u, chunk_kda_solve_tril
    from cula_runtime.cute.kda.output import chunk_kda_fwd_o
    from cula_runtime.cute.kda.prepare import kda_prepare
    from cula_runtime.cute.kda.recurrence import chunk_kda_fwd_h

    cu, scale = kwargs.get("cu_seqlens"), kwargs["q"].shape[-1] ** -0.5
    q, k, g_cum, beta = kda_prepare(
        kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"], A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"),
        lower_bound=kwargs["lower_bound"], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    Aqk, Akk = chunk_kda_fwd_scores(q, k, g_cum, beta, scale, cu)
    Akk_inv = chunk_kda_solve_tril(Akk, cu, unrolled=True)
    w, u, qg, kg = chunk_kda_recompute_w_u(k, kwargs["v"], g_cum, beta, Akk_inv, q=q, cu_seqlens=cu)
    h0 = kwargs.get("initial_state")
    h, v_new, _ = chunk_kda_fwd_h(kg, w, u, g_cum, None if h0 is None else h0.float(), True, cu,
                                  state_v_first=kwargs["state_v_first"])
    o = chunk_kda_fwd_o(qg, v_new, Aqk, h, scale, cu, state_v_first=kwargs["state_v_first"])
    torch.cuda.synchronize()
    assert torch.isfinite(o).all()


if __name__ == "__main__":
    from cula.kda import kda_prefill

    kwargs = make_inputs(SHAPES[sys.argv[1]], "cuda")
    o, ht = kda_prefill(**kwargs)
    torch.cuda.synchronize()
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    if os.environ.get("CULA_BACKEND") == "cutedsl":
        modular_primitives(kwargs)
        from cula_runtime.cute.kda.intra import variant_flags

        # the other pipeline: kda_prepare -> intra when the first run fused prepare into intra, and the other way
        os.environ["CULA_CUTE_INTRA"] = "lean-unrolled" if variant_flags(None)[3] else "fused-prepare-prefetch-8warps"
        o, ht = kda_prefill(**kwargs)
        torch.cuda.synchronize()
        assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    print(f"{sys.argv[1]}: ok, o {tuple(o.shape)}")
