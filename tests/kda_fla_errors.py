"""FLA Triton chunk_kda error against the fp64 oracle on tests/kda_cases.py (seed 0).

Measured by benchmarks/fla_error_bounds.py on NVIDIA H200
(torch 2.11.0+cu130, fla-core 0.6.0, FLA_FLASH_KDA=0) on 2026-11-29. Do not edit by hand."""

FLA_ERRORS = {
    'B1-T1-H2': (3.9150e-03, 7.4690e-04),
    'B1-T63-H2': (3.7690e-03, 2.6160e-03),
    'B1-T64-H2': (3.7790e-03, 3.2460e-03),
    'B1-T65-H2': (4.2380e-03, 2.8240e-03),
    'B2-T200-H4': (4.0370e-03, 3.1580e-03),
    'B2-T1000-H4-betabf16': (4.0790e-03, 2.7930e-03),
    'B1-T2048-H8': (4.1540e-03, 2.8450e-03),
    'B3-T130-H2-noh0': (4.1130e-03, 3.3250e-03),
    'B2-T300-H2-h0bf16': (4.0580e-03, 2.8180e-03),
    'B2-T257-H2-vk': (3.9170e-03, 2.8430e-03),
    'B1-T500-H4-nofinal': (4.0450e-03, 0.0000e+00),
    'B1-T333-H2-scale0.05': (4.0490e-03, 3.2300e-03),
    'B2-T200-H2-HV4': (3.9840e-03, 3.1010e-03),
    'B1-T700-H2-HV8': (4.1920e-03, 2.8660e-03),
    'B2-T129-H4-HV8-vk': (3.9430e-03, 2.9000e-03),
    'B1-T1000-H1-HV4-betabf16': (4.0020e-03, 3.0860e-03),
    'B1-T300-H2-gate-precomputed': (3.9660e-03, 2.6910e-03),
    'B1-T300-H2-gate-precomputed-bf16': (4.0400e-03, 2.7190e-03),
    'B1-T300-H2-rawgate-bf16': (4.0810e-03, 3.3540e-03),
    'B1-T300-H2-no-l2norm': (3.3780e-03, 2.7820e-03),
    'B1-T300-H2-beta-activated': (4.0480e-03, 3.1870e-03),
    'B1-T300-H2-beta-activated-bf16': (4.0510e-03, 3.2070e-03),
    'B1-T1000-H2-weak-decay': (3.8430e-03, 2.3940e-03),
    'B1-T1000-H2-strong-decay': (4.7450e-03, 4.2220e-03),
    'varlen-0-15': (3.3685e-03, 2.7862e-03),
    'varlen-0-100-100-228': (3.9397e-03, 2.2507e-04),
    'varlen-0-1-64-65-200': (3.9562e-03, 7.9492e-04),
    'varlen-0-0-70': (3.7588e-03, 1.8891e-04),
    'varlen-0-256-500-1000-betabf16': (4.0697e-03, 2.7205e-03),
    'varlen-6seqs-GVA2-vk': (4.0689e-03, 2.9848e-03),
    'varlen-5seqs-noh0': (4.2019e-03, 3.1169e-03),
    'varlen-3seqs-h0bf16-GVA4': (4.0654e-03, 1.6471e-04),
}
