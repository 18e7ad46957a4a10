"""Hashes of cula-sm90's outputs and workspace per intra form, for bit-identity checks across builds (on a GPU).

    python tools/hash_sm90_outputs.py TAG [--configs "fixed B1 T1024,varlen T4096 20xuniform"] [--forms tensor,bands]

For each config of ``benchmarks/bench_kda_prefill.py`` (its inputs, seed 7) and each intra form, runs
``cula_sm90.kda.run_kernels`` and prints ``HASH <TAG> <config> <form> <sha256 prefix>`` over o, the final state and
the w, u, qg and kg workspace (Aqk's blocks above the diagonal are never written, so Aqk is left out). Two builds of
the same arithmetic print the same lines; ``tools/h200_intra_ab.sh`` runs it after each build.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

DEFAULT_CONFIGS = "fixed B1 T1024,varlen T4096 20xuniform,varlen T4096 10xrandom,GVA H16 HV64 B2 T8192"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tag")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--forms", default="tensor,bands", help="comma-separated CULA_SM90_INTRA_TUNED forms")
    opts = parser.parse_args()

    import torch
    from bench_kda_prefill import make_inputs, named_configs

    from cula_runtime.kda_args import validate_kda_prefill
    from cula_sm90.kda import run_kernels

    for cfg in named_configs(opts.configs):
        args = validate_kda_prefill(**make_inputs(cfg, seed=7))
        for form in opts.forms.split(","):
            o, final_state, workspace = run_kernels(args, intra_tuned=form)
            digest = hashlib.sha256()
            for t in (o, final_state, workspace["w"], workspace["u"], workspace["qg"], workspace["kg"]):
                digest.update(t.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            print(f"HASH {opts.tag} {cfg.name} {form} {digest.hexdigest()[:16]}", flush=True)


if __name__ == "__main__":
    main()
