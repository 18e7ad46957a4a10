"""FLA 0.6.0's rel. L2 error (o, the states) against the fp64 oracle on tests/lightning_cases.py (seed 0).

Measured by benchmarks/fla_lightning_error_bounds.py on NVIDIA H100 80GB HBM3
(torch 2.11.0+cu130, fla-core 0.6.0, FLA_FLASH_KDA=0, FLA_CULA=0) on 2026-12-06.
NaN: FLA's values were not finite on that output (not measured); its bound follows tests/lightning_cases.py's rule
for NaN entries: prefill-fixed-B2-T200-h0-kfirst, prefill-fixed-B2-T200-h0-vfirst,
prefill-packed-0-1-64-130-0-257-h0-kfirst, prefill-packed-0-1-64-130-0-257-h0-vfirst,
prefill-packed-63-65-tails-kfirst, prefill-packed-63-65-tails-vfirst, prefill-layer3of8-B2-T100,
pool-prefill-fixed-B4-T80-padding-kfirst-fp32-pool, pool-prefill-fixed-B4-T80-padding-kfirst-bf16-pool,
pool-prefill-fixed-B4-T80-padding-vfirst-fp32-pool, pool-prefill-fixed-B4-T80-padding-vfirst-bf16-pool,
pool-prefill-packed-0-5-64-200-padding-kfirst-fp32-pool, pool-prefill-packed-0-5-64-200-padding-kfirst-bf16-pool,
pool-prefill-packed-0-5-64-200-padding-vfirst-fp32-pool, pool-prefill-packed-0-5-64-200-padding-vfirst-bf16-pool.
Do not edit by hand."""

LIGHTNING_FLA_ERRORS: dict[str, tuple[float, float]] = {
    'prefill-fixed-B2-T200-h0-kfirst': (2.3498e-03, float("nan")),
    'prefill-fixed-B2-T200-h0-vfirst': (2.3495e-03, float("nan")),
    'prefill-fixed-B3-T64-kfirst': (2.3241e-03, 5.9082e-04),
    'prefill-fixed-B3-T64-vfirst': (2.3241e-03, 5.9082e-04),
    'prefill-packed-0-1-64-130-0-257-h0-kfirst': (2.3685e-03, float("nan")),
    'prefill-packed-0-1-64-130-0-257-h0-vfirst': (2.3541e-03, float("nan")),
    'prefill-packed-63-65-tails-kfirst': (2.3333e-03, float("nan")),
    'prefill-packed-63-65-tails-vfirst': (2.3333e-03, float("nan")),
    'prefill-layer3of8-B2-T100': (2.3402e-03, float("nan")),
    'pool-prefill-fixed-B4-T80-padding-kfirst-fp32-pool': (2.3667e-03, float("nan")),
    'pool-prefill-fixed-B4-T80-padding-kfirst-bf16-pool': (2.3656e-03, float("nan")),
    'pool-prefill-fixed-B4-T80-padding-vfirst-fp32-pool': (2.3615e-03, float("nan")),
    'pool-prefill-fixed-B4-T80-padding-vfirst-bf16-pool': (2.3579e-03, float("nan")),
    'pool-prefill-packed-0-5-64-200-padding-kfirst-fp32-pool': (2.3626e-03, float("nan")),
    'pool-prefill-packed-0-5-64-200-padding-kfirst-bf16-pool': (2.3600e-03, float("nan")),
    'pool-prefill-packed-0-5-64-200-padding-vfirst-fp32-pool': (2.3366e-03, float("nan")),
    'pool-prefill-packed-0-5-64-200-padding-vfirst-bf16-pool': (2.3368e-03, float("nan")),
    'decode-fixed-B6-T1-kfirst-fp32-pool': (1.7016e-03, 1.7251e-08),
    'decode-fixed-B6-T1-kfirst-bf16-pool': (1.6880e-03, 4.1833e-10),
    'decode-fixed-B6-T1-vfirst-fp32-pool': (1.6535e-03, 1.7369e-08),
    'decode-fixed-B6-T1-vfirst-bf16-pool': (1.6578e-03, 0.0000e+00),
    'decode-packed-0-1-2-5-kfirst-fp32-pool': (1.6874e-03, 4.9260e-08),
    'decode-packed-0-1-2-5-kfirst-bf16-pool': (1.6757e-03, 9.5989e-08),
    'decode-packed-0-1-2-5-vfirst-fp32-pool': (1.6140e-03, 4.9705e-08),
    'decode-packed-0-1-2-5-vfirst-bf16-pool': (1.6235e-03, 0.0000e+00),
    'decode-packed-5-2-0-1-padding-kfirst-fp32-pool': (1.6336e-03, 5.3515e-08),
    'decode-packed-5-2-0-1-padding-kfirst-bf16-pool': (1.6413e-03, 5.7055e-08),
    'decode-packed-5-2-0-1-padding-vfirst-fp32-pool': (1.6194e-03, 5.3827e-08),
    'decode-packed-5-2-0-1-padding-vfirst-bf16-pool': (1.6196e-03, 4.6985e-07),
}
