"""Would moving w and u into the recurrence keep the accuracy bar? A CPU emulation of two rounding recipes.

    python benchmarks/precision_split_wu.py [--out benchmarks/results/kda_split_wu_precision_cpu.md]

STATUS.md's idea 1 for the sm90 kernels (FlashKDA's split): the intra kernel stops computing w = Tinv·(β k e^Γ) and
u = Tinv·(β v); it writes bf16(k e^Γ) and bf16(Tinv·diag(β)) instead, and the recurrence computes
v_new = (Tinv·diag(β)) · (v - (k e^Γ) S) on its chain. The two are equal in exact arithmetic; they round differently.
This script runs both recipes on tests/kda_cases.py (seed 0), in fp32 with bf16 roundings where each kernel rounds,
and reports each one's rel-L2 error of o and of the final state against the fp64 recurrence, beside FLA's own error on
the H200 (tests/kda_fla_errors.py, the 1.25x bar). Nothing runs on a GPU.

- "fla" (the sm90 kernels today, FLA's recipe): Tinv, w, u, kg, qg, Aqk and v_new rounded to bf16 once each,
  w = bf16(Tinv_bf · bf16(β k e^Γ)), u = bf16(Tinv_bf · bf16(β v)), v_new = bf16(u - w · bf16(S)).
- "split": ke = bf16(k e^Γ), Tb = bf16(Tinv · diag(β)), d = bf16(v - ke · bf16(S)), v_new = bf16(Tb · d).
- "split-tf32": the same with Tb and d rounded to tf32 (a tf32 MMA for the second product) instead of bf16.
- "split-bf16T-tf32d": Tb stored in bf16 (exact in tf32), d rounded to tf32: the tf32 MMA with half of split-tf32's
  bytes for Tb.

Both: q, k normalised then rounded to bf16; the cumulative gate Γ in fp32 (pairwise exponents formed directly);
o = bf16(scale · qg · bf16(S) + Aqk · v_new); S = e^{Γ_last} S + kgᵀ v_new in fp32. fp32 matmuls on the CPU sum in
another order than the tensor cores, so compare the two recipes with each other, not the "fla" column with the H200.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cula_runtime.reference.preprocess import expand_qk_heads, prepare_kda_inputs  # noqa: E402
from tests.helpers import rel_l2  # noqa: E402
from tests.kda_cases import CASES, make_inputs, oracle  # noqa: E402
from tests.kda_fla_errors import FLA_ERRORS  # noqa: E402

CHUNK = 64
RECIPES = ("fla", "split", "split-tf32", "split-bf16T-tf32d")


def bf(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 and back (a kernel's bf16 store or MMA operand)."""
    return x.to(torch.bfloat16).float()


def tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to tf32's 10-bit mantissa (nearest, ties away; a tf32 MMA operand) and back."""
    bits = x.contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def pairwise_scores(q: torch.Tensor, k: torch.Tensor, gam: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ_k q_i k_j e^{Γi-Γj}, Σ_k k_i k_j e^{Γi-Γj})`` for j <= i (0 above), every factor formed pair by pair in
    fp32. q, k ``[HV, L, K]``, gam ``[HV, L, K]`` (Γ, natural log); both results ``[HV, L, L]``, before scale/β."""
    L = q.shape[1]
    diff = gam.unsqueeze(2) - gam.unsqueeze(1)  # [HV, i, j, K]: Γ_i - Γ_j
    lower = torch.tril(torch.ones(L, L, dtype=torch.bool))
    pair = torch.exp(torch.where(lower.unsqueeze(-1), diff, torch.full_like(diff, -torch.inf)))
    return torch.einsum("hik,hjk,hijk->hij", q, k, pair), torch.einsum("hik,hjk,hijk->hij", k, k, pair)


def chunk_step(recipe: str, S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, scale: float, scores=pairwise_scores) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of every head at once. S ``[HV, K, V]`` fp32; q, k ``[HV, L, K]`` (bf16 values), v ``[HV, L, V]``,
    g ``[HV, L, K]`` log-gate, beta ``[HV, L]``; ``scores(q, k, Γ)`` forms Aqk and Akk before scale and β (see
    :func:`pairwise_scores`). Returns (o ``[HV, L, V]``, the next S)."""
    L = q.shape[1]
    gam = torch.cumsum(g, dim=1)  # Γ
    qk, kk = scores(q, k, gam)
    lower = torch.tril(torch.ones(L, L))
    aqk = bf(scale * qk * lower)
    strict = torch.tril(torch.ones(L, L), diagonal=-1)
    akk = beta.unsqueeze(-1) * kk * strict
    eye = torch.eye(L).expand_as(akk)
    tinv = torch.linalg.solve_triangular(eye + akk, eye, upper=False, unitriangular=True)
    qg = bf(q * torch.exp(gam))
    kg = bf(k * torch.exp(gam[:, -1:, :] - gam))
    S_bf = bf(S)
    if recipe == "fla":
        tb = bf(tinv)
        w = bf(tb @ bf(beta.unsqueeze(-1) * k * torch.exp(gam)))
        u = bf(tb @ bf(beta.unsqueeze(-1) * v))
        v_new = bf(u - w @ S_bf)
    else:
        t_round = bf if recipe in ("split", "split-bf16T-tf32d") else tf32  # how Tinv·diag(β) is stored
        d_round = bf if recipe == "split" else tf32  # the second product's other operand (bf16, or a tf32 MMA)
        ke = bf(k * torch.exp(gam))
        tb = t_round(tinv * beta.unsqueeze(1))  # Tinv · diag(β): column j scaled by β_j
        d = d_round(v - ke @ S_bf)
        v_new = bf(tb @ d)
    o = bf(scale * (qg @ S_bf) + torch.tril(aqk) @ v_new)
    S = torch.exp(gam[:, -1, :]).unsqueeze(-1) * S + kg.transpose(1, 2) @ v_new
    return o, S


def emulate(kwargs: dict, recipe: str, scores=pairwise_scores) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[B, T, HV, V]`` and the final state ``[N, HV, K, V]`` (K-first) of one kda_prefill call, fp32
    (``scores``: as :func:`chunk_step`'s)."""
    q, k, g, beta = prepare_kda_inputs(
        kwargs["q"], kwargs["k"], kwargs["g"], kwargs["beta"], dtype=torch.float32,
        use_qk_l2norm_in_kernel=kwargs["use_qk_l2norm_in_kernel"], use_gate_in_kernel=kwargs["use_gate_in_kernel"],
        use_beta_sigmoid_in_kernel=kwargs["use_beta_sigmoid_in_kernel"], lower_bound=kwargs.get("lower_bound"),
        A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"))
    q, k = bf(q), bf(k)  # the kernels keep the normalised q, k in bf16
    v = kwargs["v"].float()
    B, T, HV, V = v.shape
    q, k = expand_qk_heads(q, HV), expand_qk_heads(k, HV)
    K = q.shape[-1]
    scale = kwargs["scale"] if kwargs["scale"] is not None else K ** -0.5
    cu = kwargs.get("cu_seqlens")
    if cu is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        bounds = cu.tolist()
        spans = [(0, a, e) for a, e in zip(bounds[:-1], bounds[1:], strict=True)]
    h0 = kwargs.get("initial_state")
    o = torch.zeros(B, T, HV, V)
    states = []
    for n, (b, start, end) in enumerate(spans):
        if h0 is None:
            S = torch.zeros(HV, K, V)
        else:
            S = h0[n].float()
            if kwargs["state_v_first"]:
                S = S.transpose(-1, -2)
        for c0 in range(start, end, CHUNK):
            c1 = min(c0 + CHUNK, end)
            sl = (b, slice(c0, c1))
            o_c, S = chunk_step(recipe, S, q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                g[sl].transpose(0, 1), beta[sl].transpose(0, 1), scale, scores)
            o[b, c0:c1] = o_c.transpose(0, 1)
        states.append(S)
    return o, torch.stack(states)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the Markdown table here as well")
    opts = parser.parse_args()
    torch.manual_seed(0)
    others = RECIPES[1:]
    lines = ["| case | o: fla recipe | state: fla recipe | " + " | ".join(f"{r}: o / fla, state / fla" for r in others)
             + " |", "|---|---|---|" + "---|" * len(others)]
    worst = {(r, x): 0.0 for r in others for x in ("o", "ht")}
    for case in CASES:
        kwargs = make_inputs(case, "cpu", seed=0)
        o_ref, ht_ref = oracle(kwargs)
        if ht_ref is not None and case.state_v_first:
            ht_ref = ht_ref.transpose(-1, -2)
        errs = {}
        for recipe in RECIPES:
            o, ht = emulate(kwargs, recipe)
            errs[recipe] = (rel_l2(o, o_ref), rel_l2(ht, ht_ref) if ht_ref is not None else 0.0)
        fla_o, fla_ht = FLA_ERRORS[case.name]
        fo, fh = errs["fla"]
        cells = []
        for recipe in others:
            ro, rh = errs[recipe]
            worst[recipe, "o"] = max(worst[recipe, "o"], ro / fla_o)
            worst[recipe, "ht"] = max(worst[recipe, "ht"], rh / fla_ht if fla_ht else 0.0)
            cells.append(f"{ro / fo:.2f}, {rh / fh if fh else 0:.2f}")
        lines.append(f"| {case.name} | {fo:.3e} | {fh:.3e} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    summary = "\nWorst error against FLA's own on the H200 (tests/kda_fla_errors.py; the bar is 1.25x): " + "; ".join(
        f"{recipe}: o {worst[recipe, 'o']:.2f}x, final state {worst[recipe, 'ht']:.2f}x" for recipe in others) + "."
    print(summary)
    if opts.out:
        write_report(opts.out, "Precision of the w/u split (STATUS idea 1), emulated on the CPU",
                     "benchmarks/precision_split_wu.py", lines, summary)


def write_report(out: str, title: str, script: str, lines: list[str], summary: str) -> None:
    """A CPU emulation's Markdown record: title, date, torch version, the command, the table and its summary."""
    head = (f"# {title}\n\n- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M UTC}; torch "
            f"{torch.__version__}; no GPU\n- command: `python {script} --out {out}`\n- method: the docstring of "
            f"{script}\n\n")
    Path(out).write_text(head + "\n".join(lines) + "\n" + summary + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
