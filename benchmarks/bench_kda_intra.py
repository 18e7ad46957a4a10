"""Microbenchmark of the KDA intra kernel alone (the chunk cumsum of the gate, Aqk/Akk, the inverse, W/U): cuLA's
CuTeDSL kernel against FLA's Triton ``chunk_kda_fwd_intra``. A microbenchmark: end-to-end numbers are
bench_kda_prefill.py's.

    python benchmarks/bench_kda_intra.py [--out benchmarks/results/kda_intra_h200.md] [--reps 50]

Inputs are what FLA's primitive receives inside a prefill: L2-normalised bf16 q/k, bf16 v, the chunk-local
cumulative safe gate in log2 units (fp32) and activated fp32 beta; H = HV = 64, K = V = 128. cuLA's kernel
(``chunk_kda_fwd_intra_from_raw``) takes the per-step log-gate instead (no activation in the kernel, ``"none"``
form) and does the chunk cumsum itself, which FLA's time leaves out; no L2 norm or β activation in either. Also
compares the outputs (rel. L2 between the two implementations) so a fast wrong kernel cannot hide.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")
# FLA's own kernels: cuLA registers itself as a backend of FLA's registry, which would make "FLA" run cuLA
os.environ["FLA_CULA"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from bench_kda_prefill import environment, time_ms  # noqa: E402

from tests.helpers import rel_l2  # noqa: E402

SIZES = ((1, 4096), (1, 16384), (2, 16384))
H = HV = 64
K = V = 128
RCP_LN2 = 1.4426950216


def inputs(B: int, T: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    q = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).bfloat16()
    k = torch.nn.functional.normalize(randn(B, T, H, K), dim=-1).bfloat16()
    g = -5.0 * torch.sigmoid(randn(B, T, HV, K))
    gk = (g.view(B, T // 64, 64, HV, K).cumsum(2).view(B, T, HV, K) * RCP_LN2).contiguous()
    return dict(q=q, k=k, v=randn(B, T, HV, V).bfloat16(), g=g, gk=gk, beta=torch.sigmoid(randn(B, T, HV)),
                scale=K**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/kda_intra_h200.md")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    from fla.ops.kda.chunk_intra import chunk_kda_fwd_intra as fla_intra

    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra_from_raw as cute_intra

    lines = ["# KDA intra kernel on the H200 (microbenchmark): CuTeDSL vs FLA Triton", "", *environment(), "",
             "| B | T | FLA ms | cula-cutedsl ms | FLA/cula | max rel. L2 (w, u, kg, Aqk) between the two |",
             "|---|---|---|---|---|---|"]
    for B, T in SIZES:
        x = inputs(B, T)

        def run_fla(x=x):
            return fla_intra(x["q"], x["k"], x["v"], gk=x["gk"], beta=x["beta"], scale=x["scale"], safe_gate=True)

        def run_cute(x=x):
            return cute_intra(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"])

        w_f, u_f, _, kg_f, aqk_f, _ = run_fla()
        w_c, u_c, _, kg_c, aqk_c, _ = run_cute()
        tril = torch.ones(64, 64, device="cuda").tril().repeat(T // 64, 1).view(1, T, 1, 64)
        diff = max(rel_l2(w_c, w_f), rel_l2(u_c, u_f), rel_l2(kg_c, kg_f),
                   rel_l2(aqk_c.float() * tril, aqk_f.float() * tril))
        t_fla, t_cute = time_ms(run_fla, args.reps), time_ms(run_cute, args.reps)
        lines.append(f"| {B} | {T} | {t_fla:.3f} | {t_cute:.3f} | {t_fla / t_cute:.2f} | {diff:.2e} |")
        print(lines[-1], flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
