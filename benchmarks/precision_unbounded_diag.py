"""The unbounded gate's diagonal blocks (issue 25): a CPU emulation of three ways to form Aqk and Akk.

    python benchmarks/precision_unbounded_diag.py [--out benchmarks/results/kda_unbounded_diag_precision_cpu.md]

The intra kernels form each 16 x 16 block of Aqk and Akk as a tensor-core product of bf16 operands, the factor
e^{Γi-Γj} split into a row factor and a column factor around an anchor (KDA_SPEC §3.7). A block below the diagonal
(query sub-chunk I > key sub-chunk J) is safe for any gate when the anchor lies between the two sub-chunks: both
factors are <= 1, and one that underflows to 0 means a product below 2^-126. On a diagonal block the safe-gate anchor
(the sub-chunk's first row) gives column factors up to e^{15 |g|max}: finite only for bounded gates. This script runs,
on the unbounded cases of tests/kda_cases.py (UNBOUNDED_CASES, seed 0) and on the safe ones for reference, in fp32
with bf16 roundings where the kernels round (benchmarks/precision_split_wu.py's "fla" recipe for everything after the
scores), three forms of the scores:

- "pairwise": every factor e^{Γi-Γj} formed pair by pair in fp32 (FLA's non-safe diagonal blocks; the torch
  reference). The accuracy bar.
- "anchored": today's safe-gate kernels. Off-diagonal: row operand bf16(q e^{Γi-Γn_I}), column operand
  bf16(k e^{Γn_J-Γj} e^{Γn_I-Γn_J}); diagonal: bf16(k e^{Γn_I-Γj}). Overflows (inf, NaN) once a sub-chunk's gates
  sum below about -88.
- "levels" (the proposal): off-diagonal column operand bf16(k e^{Γn_{J+1}-Γj} e^{Γn_I-Γn_{J+1}}) (two factors <= 1);
  each diagonal block split by the binary tree of its 16 rows: the pairs whose local indices first differ in bit b
  (i has it, j not) are one product per level b = 3..0 with the anchor m = i's index with the bits below b cleared,
  row operand bf16(q_i e^{Γi-Γm}) and column operand bf16(k_j e^{Γm-Γj}), both <= 1 (j < m <= i); the diagonal of
  Aqk as the fp32 dot product q_i·k_i. Exact in exponent range for every gate g <= 0; on the tensor cores the four
  levels pack into two 16 x 16 x K products per block (levels 3 and 2 in one, 1 and 0 in the other: every token has
  one role per level).
- "levels-f16" (the sm90 form "unbounded" with the q/k L2 norm in kernel): "levels" with the normalised q, k rounded
  to fp16 instead of bf16 (for the whole chunk: the kernel keeps them in fp16 tiles) and every score product in fp16
  (fp16 MMAs): each diagonal operand and each row operand below the diagonal the fp16 product of the fp16 q or k and
  the fp16-rounded fp32 factor, fp16(x fp16(e^{...})); each column operand below the diagonal fp16(k e^{..} e^{..})
  (its two factors multiplied in fp32); the stores bf16 as in "levels". Without the norm in kernel it is "levels".

Reported: each form's rel-L2 error of o and the final state against the fp64 recurrence, and whether any output is
not finite. fp32 matmuls on the CPU sum in another order than the tensor cores: compare forms with each other.

``--softplus`` instead compares two fp32 forms of the in-kernel softplus gate ``-exp(A_log) softplus(g + dt_bias)``
(the CuTeDSL intra kernel's activation, :func:`cula_runtime.cute.kda.gate.activate_gate`): "log1p-exp" (its form
before 2026-12: ``x`` above 20, else ``log1p(exp(x))``, precise library functions) and "ex2-lg2" (``max(x, 0) +
ln 2 log2(1 + e)``, ``e = 2^(-|x| log2 e)``: one MUFU.EX2 and one MUFU.LG2; for ``e < 2^-5`` the series of
log2(1 + e) to ``e^4`` instead, which keeps the relative accuracy of tiny gates). The MUFU ops are modelled as the
fp32 functions with their documented worst error added with one sign everywhere (ex2: relative 2^-22, lg2: absolute
2^-22): a biased model, the worst case for sums over long sequences. Reported: the gate's worst absolute and
relative error against fp64 on a grid of x, and the o / final-state errors of the in-kernel Kimi cases (the gate
precomputed in each form, then the "levels" emulation) against the fp64 oracle.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.precision_split_wu import CHUNK, bf, chunk_step, emulate, pairwise_scores, write_report  # noqa: E402
from cula_runtime.reference.preprocess import expand_qk_heads, prepare_kda_inputs  # noqa: E402
from tests.helpers import rel_l2  # noqa: E402
from tests.kda_cases import CASES, UNBOUNDED_CASES, make_inputs, oracle  # noqa: E402

SUB = 16
FORMS = ("pairwise", "anchored", "levels", "levels-f16")


def half(x: torch.Tensor) -> torch.Tensor:
    """Round to fp16 and back (subnormals kept, as the fp16 arithmetic of the tensor cores and HFMA2 keeps them)."""
    return x.to(torch.float16).float()


def _blocks(q: torch.Tensor, k: torch.Tensor, gam: torch.Tensor, diagonal) -> tuple[torch.Tensor, torch.Tensor]:
    """Aqk and Akk (before scale and β) of one chunk, block by block: below the diagonal the off-diagonal form chosen
    by ``diagonal`` (its name), on it ``diagonal``'s own form. Shapes as :func:`pairwise_scores`."""
    HV, L, K = q.shape
    P = -(-L // SUB) * SUB
    qp, kp = q.new_zeros(HV, P, K), k.new_zeros(HV, P, K)
    qp[:, :L], kp[:, :L] = q, k
    gp = torch.cat([gam, gam[:, -1:].expand(HV, P - L, K)], dim=1)  # past the end: Γ stays at Γ_last
    qk, kk = q.new_zeros(HV, P, P), q.new_zeros(HV, P, P)
    starts = list(range(0, P, SUB))
    f16 = diagonal == "levels-f16"
    for block, n in enumerate(starts):
        rows = slice(n, n + SUB)
        row_factor = torch.exp(gp[:, rows] - gp[:, n:n + 1])  # e^{Γi - Γn_I} <= 1
        if f16:
            rq, rk = half(qp[:, rows] * half(row_factor)), half(kp[:, rows] * half(row_factor))
        else:
            rq, rk = bf(qp[:, rows] * row_factor), bf(kp[:, rows] * row_factor)
        for J in range(block):
            m = starts[J]
            cols = slice(m, m + SUB)
            if diagonal == "anchored":  # e^{Γn_J - Γj} (>= 1) times e^{Γn_I - Γn_J}
                col = kp[:, cols] * torch.exp(gp[:, m:m + 1] - gp[:, cols]) * torch.exp(gp[:, n:n + 1] - gp[:, m:m + 1])
            else:  # e^{Γn_{J+1} - Γj} and e^{Γn_I - Γn_{J+1}}, both <= 1
                nxt = m + SUB
                col = (kp[:, cols] * torch.exp(gp[:, nxt:nxt + 1] - gp[:, cols])
                       * torch.exp(gp[:, n:n + 1] - gp[:, nxt:nxt + 1]))
            col = half(col) if f16 else bf(col)
            qk[:, rows, cols] = rq @ col.transpose(1, 2)
            kk[:, rows, cols] = rk @ col.transpose(1, 2)
        dq, dk = _diagonal_block(diagonal, qp[:, rows], kp[:, rows], gp[:, rows], rq, rk)
        qk[:, rows, rows], kk[:, rows, rows] = dq, dk
    lower = torch.tril(torch.ones(P, P))
    return (qk * lower)[:, :L, :L], (kk * lower)[:, :L, :L]


def _diagonal_block(form: str, q: torch.Tensor, k: torch.Tensor, gam: torch.Tensor, rq: torch.Tensor,
                    rk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One diagonal block's (q·k, k·k) products, ``[HV, 16, 16]`` (masking above the diagonal is the caller's)."""
    if form == "anchored":
        col = bf(k * torch.exp(gam[:, :1] - gam))  # e^{Γn - Γj}: >= 1, overflows for unbounded gates
        return rq @ col.transpose(1, 2), rk @ col.transpose(1, 2)
    operand = (lambda x, f: half(x * half(f))) if form == "levels-f16" else (lambda x, f: bf(x * f))
    HV, n, K = q.shape
    idx = torch.arange(n)
    qk, kk = q.new_zeros(HV, n, n), q.new_zeros(HV, n, n)
    for b in range(int(math.log2(n)) - 1, -1, -1):
        bit = 1 << b
        is_row = (idx & bit) != 0
        anchor = torch.where(is_row, idx & ~(bit - 1), (idx | bit) & ~(bit - 1))  # (for a row, its bits < b cleared)
        g_anchor = gam[:, anchor]
        factor = torch.exp(torch.where(is_row[None, :, None], gam - g_anchor, g_anchor - gam))  # <= 1 both ways
        row_q, row_k, col = operand(q, factor), operand(k, factor), operand(k, factor)
        pair = (is_row[:, None] & ~is_row[None, :]) & ((idx[:, None] >> (b + 1)) == (idx[None, :] >> (b + 1)))
        qk = qk + torch.where(pair, row_q @ col.transpose(1, 2), 0.0)
        kk = kk + torch.where(pair, row_k @ col.transpose(1, 2), 0.0)
    qk = qk + torch.diag_embed((q * k).sum(-1))  # Aqk's diagonal: e^0 = 1, an fp32 dot product
    return qk, kk


def scores_of(form: str):
    """The ``scores`` callable of :func:`~benchmarks.precision_split_wu.chunk_step` for ``form``."""
    if form == "pairwise":
        return pairwise_scores
    return lambda q, k, gam: _blocks(q, k, gam, form)


def emulate_half_qk(kwargs: dict, scores) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~benchmarks.precision_split_wu.emulate` ("fla" recipe) with the normalised q, k rounded to fp16 instead
    of bf16 (the sm90 form "unbounded" with the norm in kernel)."""
    q, k, g, beta = prepare_kda_inputs(
        kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"], dtype=torch.float32,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=kwargs["use_gate_in_kernel"],
        use_beta_sigmoid_in_kernel=kwargs["use_beta_sigmoid_in_kernel"], lower_bound=kwargs.get("lower_bound"),
        A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"))
    q, k = half(q), half(k)
    v = kwargs["v"].float()
    B, T, HV, V = v.shape
    q, k = expand_qk_heads(q, HV), expand_qk_heads(k, HV)
    K = q.shape[-1]
    scale = kwargs["scale"] if kwargs["scale"] is not None else K ** -0.5
    cu = kwargs.get("cu_seqlens")
    spans = [(b, 0, T) for b in range(B)] if cu is None else [(0, a, e) for a, e in zip(cu[:-1].tolist(),
                                                                                          cu[1:].tolist(), strict=True)]
    h0 = kwargs.get("initial_state")
    o = torch.zeros(B, T, HV, V)
    states = []
    for n, (b, start, end) in enumerate(spans):
        S = torch.zeros(HV, K, V) if h0 is None else h0[n].float()
        if h0 is not None and kwargs["state_v_first"]:
            S = S.transpose(-1, -2)
        for c0 in range(start, end, CHUNK):
            sl = (b, slice(c0, min(c0 + CHUNK, end)))
            o_c, S = chunk_step("fla", S, q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                g[sl].transpose(0, 1), beta[sl].transpose(0, 1), scale, scores)
            o[b, sl[1]] = o_c.transpose(0, 1)
        states.append(S)
    return o, torch.stack(states)


def measure(case) -> dict[str, tuple[float, float, bool]]:
    """form -> (o error, final-state error, every output finite) on ``case`` against the fp64 oracle."""
    kwargs = make_inputs(case, "cpu", seed=0)
    o_ref, ht_ref = oracle(kwargs)
    if ht_ref is not None and case.state_v_first:
        ht_ref = ht_ref.transpose(-1, -2)
    out = {}
    for form in FORMS:
        if form == "levels-f16" and kwargs["use_qk_l2norm_in_kernel"]:
            o, ht = emulate_half_qk(kwargs, scores_of(form))
        else:
            o, ht = emulate(kwargs, "fla", scores_of("levels" if form == "levels-f16" else form))
        finite = bool(torch.isfinite(o).all() and torch.isfinite(ht).all())
        out[form] = (rel_l2(o, o_ref) if finite else math.inf,
                     (rel_l2(ht, ht_ref) if finite else math.inf) if ht_ref is not None else 0.0, finite)
    return out


LOG2_E, LN2 = 1.4426950408889634, 0.6931471805599453
MUFU_ERROR = 2.0 ** -22  # ex2.approx: relative; lg2.approx: absolute (on [1, 2])
SERIES_BELOW = 2.0 ** -5  # e^-|x| below this: log1p by its series (the kernel's switch)
SOFTPLUS_FORMS = ("log1p-exp", "ex2-lg2", "ex2-lg2 biased -", "ex2-lg2 biased +")


def softplus_fp32(x: torch.Tensor, form: str) -> torch.Tensor:
    """softplus of fp32 ``x`` in ``form`` (:data:`SOFTPLUS_FORMS`), fp32; "biased -"/"+" add the MUFU ops' worst
    error with that sign everywhere."""
    x = x.float()
    if form == "log1p-exp":
        return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    sign = {"ex2-lg2": 0.0, "ex2-lg2 biased -": -1.0, "ex2-lg2 biased +": 1.0}[form]
    e = torch.exp2(-x.abs() * LOG2_E) * (1.0 + sign * MUFU_ERROR)
    lg = torch.log2(1.0 + e) + sign * MUFU_ERROR
    # e < 2^-5: log2(1 + e) by its series to e^4 (relative error below e^4 / 5 < 2^-22), as the kernel does
    series = e * (LOG2_E + e * (-LOG2_E / 2 + e * (LOG2_E / 3 - e * (LOG2_E / 4))))
    lg = torch.where(e < SERIES_BELOW, series, lg)
    return (torch.clamp(x, min=0.0) + lg * LN2).float()


def softplus_report() -> tuple[list[str], str]:
    """The ``--softplus`` tables (see the module docstring)."""
    x = torch.linspace(-40.0, 40.0, 400_001, dtype=torch.float64).float()
    exact = torch.nn.functional.softplus(x.double())
    lines = ["| softplus form | worst abs error, x in [-40, 40] | worst rel error, x in [-5, 40] | "
             "worst rel error, x in [-40, -5] |", "|---|---|---|---|"]
    for form in SOFTPLUS_FORMS:
        err = (softplus_fp32(x, form).double() - exact).abs()
        rel = err / exact
        lines.append(f"| {form} | {err.max():.2e} | {rel[x >= -5].max():.2e} | {rel[x < -5].max():.2e} |")
    lines += ["", "| case | " + " | ".join(f"{f}: o, state" for f in SOFTPLUS_FORMS) + " | ex2-lg2 (worst of the "
              "three) / log1p-exp: o, state |", "|---|" + "---|" * (len(SOFTPLUS_FORMS) + 1)]
    worst = [0.0, 0.0]
    for case in [c for c in UNBOUNDED_CASES if c.gate == "kimi" and c.gate_in_kernel]:
        kwargs = make_inputs(case, "cpu", seed=0)
        o_ref, ht_ref = oracle(kwargs)
        if ht_ref is not None and case.state_v_first:
            ht_ref = ht_ref.transpose(-1, -2)
        HV, K = kwargs["g"].shape[2], kwargs["g"].shape[3]
        bias = kwargs["dt_bias"].view(HV, K) if "dt_bias" in kwargs else torch.zeros(HV, K)
        xs = kwargs["g"].float() + bias
        errs = {}
        for form in SOFTPLUS_FORMS:
            call = dict(kwargs, use_gate_in_kernel=False, A_log=None, dt_bias=None,
                        g=-kwargs["A_log"].exp()[:, None] * softplus_fp32(xs, form))
            o, ht = emulate(call, "fla", scores_of("levels"))
            errs[form] = (rel_l2(o, o_ref), rel_l2(ht, ht_ref) if ht_ref is not None else 0.0)
        base = errs["log1p-exp"]
        ratio = [max(errs[f][i] for f in SOFTPLUS_FORMS[1:]) / base[i] if base[i] else 0.0 for i in range(2)]
        worst = [max(worst[i], ratio[i]) for i in range(2)]
        lines.append(f"| {case.name} | " + " | ".join(f"{errs[f][0]:.4e}, {errs[f][1]:.4e}" for f in SOFTPLUS_FORMS)
                     + f" | {ratio[0]:.4f}, {ratio[1]:.4f} |")
        print(lines[-1], flush=True)
    summary = (f"\nWorst ex2-lg2 / log1p-exp error ratio on the in-kernel Kimi cases: o {worst[0]:.4f}x, final "
               f"state {worst[1]:.4f}x.")
    return lines, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the Markdown table here as well")
    parser.add_argument("--safe", type=int, default=6, help="how many of the safe-gate cases to run beside them")
    parser.add_argument("--softplus", action="store_true", help="compare the softplus gate's fp32 forms instead")
    opts = parser.parse_args()
    if opts.softplus:
        lines, summary = softplus_report()
        print("\n".join(lines[:len(SOFTPLUS_FORMS) + 2]), summary, sep="\n")
        if opts.out:
            write_report(opts.out, "The in-kernel softplus gate's fp32 forms, emulated on the CPU",
                         "benchmarks/precision_unbounded_diag.py --softplus", lines, summary)
        return
    torch.manual_seed(0)
    lines = ["| case | gate | " + " | ".join(f"{f}: o, state" for f in FORMS)
             + " | levels / pairwise: o, state | levels-f16 / pairwise: o, state |",
             "|---|---|" + "---|" * (len(FORMS) + 2)]
    worst = [0.0, 0.0]
    worst_half = [0.0, 0.0]
    for case in [*UNBOUNDED_CASES, *CASES[: opts.safe]]:
        errs = measure(case)
        cells = [f"{o:.3e}, {h:.3e}" if ok else "not finite" for o, h, ok in (errs[f] for f in FORMS)]
        po, ph, _ = errs["pairwise"]
        lo, lh, _ = errs["levels"]
        ratio = (lo / po, lh / ph if ph else 0.0)
        worst = [max(worst[0], ratio[0]), max(worst[1], ratio[1])]
        ho, hh, _ = errs["levels-f16"]
        ratio_half = (ho / po, hh / ph if ph else 0.0)
        worst_half = [max(worst_half[0], ratio_half[0]), max(worst_half[1], ratio_half[1])]
        lines.append(f"| {case.name} | {case.gate} | " + " | ".join(cells) + f" | {ratio[0]:.3f}, {ratio[1]:.3f} | "
                     f"{ratio_half[0]:.3f}, {ratio_half[1]:.3f} |")
        print(lines[-1], flush=True)
    summary = (f"\nWorst levels/pairwise error ratio: o {worst[0]:.3f}x, final state {worst[1]:.3f}x; "
               f"levels-f16/pairwise: o {worst_half[0]:.3f}x, final state {worst_half[1]:.3f}x (the bar against "
               "FLA's own error is 1.25x).")
    print(summary)
    if opts.out:
        write_report(opts.out, "The unbounded gate's diagonal blocks, emulated on the CPU",
                     "benchmarks/precision_unbounded_diag.py", lines, summary)


if __name__ == "__main__":
    main()
