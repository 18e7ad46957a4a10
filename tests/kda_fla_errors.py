"""FLA Triton chunk_kda error against the fp64 oracle on tests/kda_cases.py (seed 0).

Measured by benchmarks/fla_error_bounds.py on NVIDIA H200 (driver 580.159.04, torch 2.11.0+cu130, triton 3.6,
fla-core 0.6.0, FLA_FLASH_KDA=0) on 2026-11-29. Cases missing here were not yet measured; their tests use
KDA_SPEC §7's 5e-3 gate instead. Do not edit by hand: rerun the script.
"""

FLA_ERRORS = {
    "B1-T1-H2": (3.915e-03, 7.469e-04),
    "B1-T63-H2": (3.769e-03, 2.616e-03),
    "B1-T64-H2": (3.779e-03, 3.246e-03),
    "B1-T65-H2": (4.238e-03, 2.824e-03),
    "B2-T200-H4": (4.037e-03, 3.158e-03),
    "B2-T1000-H4-betabf16": (4.079e-03, 2.793e-03),
    "B1-T2048-H8": (4.154e-03, 2.845e-03),
    "B3-T130-H2-noh0": (4.113e-03, 3.325e-03),
    "B2-T300-H2-h0bf16": (4.058e-03, 2.818e-03),
    "B2-T257-H2-vk": (3.917e-03, 2.843e-03),
    "B1-T500-H4-nofinal": (4.045e-03, 0.000e00),
    "B1-T333-H2-scale0.05": (4.049e-03, 3.230e-03),
    "B2-T200-H2-HV4": (3.984e-03, 3.101e-03),
    "B1-T700-H2-HV8": (4.192e-03, 2.866e-03),
    "B2-T129-H4-HV8-vk": (3.943e-03, 2.900e-03),
    "B1-T1000-H1-HV4-betabf16": (4.002e-03, 3.086e-03),
    "B1-T300-H2-gate-precomputed": (3.966e-03, 2.691e-03),
    "B1-T300-H2-gate-precomputed-bf16": (4.040e-03, 2.719e-03),
    "B1-T300-H2-rawgate-bf16": (4.081e-03, 3.354e-03),
    "B1-T300-H2-no-l2norm": (3.378e-03, 2.782e-03),
    "B1-T300-H2-beta-activated": (4.048e-03, 3.187e-03),
    "B1-T300-H2-beta-activated-bf16": (4.051e-03, 3.207e-03),
    "B1-T1000-H2-weak-decay": (3.843e-03, 2.394e-03),
    "B1-T1000-H2-strong-decay": (4.745e-03, 4.222e-03),
}
