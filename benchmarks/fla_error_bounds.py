"""Measure FLA Triton ``chunk_kda``'s error against the fp64 oracle on every case of ``tests/kda_cases.py``.

Run on the H200 (needs fla-core==0.6.0; FLA_FLASH_KDA=0 is set here so FLA never hands off to FlashKDA):
    python benchmarks/fla_error_bounds.py OUT.py [comma-separated case names | missing]
writes a Python module ``FLA_ERRORS = {case name: (rel. L2 error of o, of the final state)}`` that the GPU tests
use as their bound (1.25 x FLA's error, and never above 1e-2). FLA appears only here, never at run time.
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

os.environ["FLA_FLASH_KDA"] = "0"
os.environ["FLA_CULA"] = "0"  # (FLA's own kernels, not cuLA through FLA's registry)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.helpers import rel_l2  # noqa: E402
from tests.kda_cases import CASES, PENDING_FLA_CASES, UNBOUNDED_CASES, make_inputs, oracle  # noqa: E402


def fla_kda(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    from fla.ops.kda import chunk_kda

    call = dict(kwargs)
    safe_gate = call.pop("safe_gate")
    if call.get("initial_state") is not None:
        call["initial_state"] = call["initial_state"].float()  # FLA takes fp32 states only
    if call.get("cu_seqlens") is not None:
        call["cu_seqlens"] = call["cu_seqlens"].long()
    return chunk_kda(**call, safe_gate=safe_gate)


def main(out_path: str, only: str = "") -> None:
    """``only``: case names to measure, or ``missing`` for those absent from tests/kda_fla_errors.py; the file
    written holds the measured cases plus, with ``missing``, the ones already recorded."""
    import fla

    known: dict = {}
    if only == "missing":
        from tests.kda_fla_errors import FLA_ERRORS as known
    rows = []
    for case in [*CASES, *UNBOUNDED_CASES, *PENDING_FLA_CASES]:
        if case.name in known or (only and only != "missing" and case.name not in only.split(",")):
            continue
        kwargs = make_inputs(case, "cuda")
        o, ht = fla_kda(kwargs)
        o_ref, ht_ref = oracle(kwargs)
        err_o = rel_l2(o.cpu(), o_ref)
        err_ht = rel_l2(ht.cpu(), ht_ref) if ht is not None else 0.0
        rows.append((case.name, err_o, err_ht))
        print(f"{case.name:40s} o {err_o:.3e}  ht {err_ht:.3e}", flush=True)
        _write(out_path, fla.__version__, known, rows)  # after every case: a time-capped run keeps what it measured


def _write(out_path: str, fla_version: str, known: dict, rows: list) -> None:
    kept = " (the cases recorded before kept from their own runs)" if known else ""
    header = (
        f'"""FLA Triton chunk_kda error against the fp64 oracle on tests/kda_cases.py (seed 0).\n\n'
        f"Measured by benchmarks/fla_error_bounds.py on {torch.cuda.get_device_name()}\n"
        f"(torch {torch.__version__}, fla-core {fla_version}, FLA_FLASH_KDA=0) on "
        f"{datetime.date.today().isoformat()}{kept}"
        '. Do not edit by hand."""\n\n'
    )
    rows = [(name, eo, eh) for name, (eo, eh) in known.items()] + rows
    body = "FLA_ERRORS = {\n" + "".join(f"    {name!r}: ({eo:.4e}, {eh:.4e}),\n" for name, eo, eh in rows) + "}\n"
    Path(out_path).write_text(header + body)


if __name__ == "__main__":
    main(*sys.argv[1:3])
