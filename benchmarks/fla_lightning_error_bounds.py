"""Measure FLA 0.6.0's Lightning error against the fp64 oracle on every case of ``tests/lightning_cases.py``.

Run on the H200 (needs fla-core==0.6.0; FLA_FLASH_KDA=0 and FLA_CULA=0 are set here, before anything imports FLA, so
FLA runs its own Triton kernels, never cuLA through FLA's backend registry):
    python benchmarks/fla_lightning_error_bounds.py OUT.py [comma-separated case names | missing]
writes a Python module ``LIGHTNING_FLA_ERRORS = {case name: (rel. L2 error of o, of the states)}``, the frozen bounds
of ``tests/gpu/test_lightning_gpu.py`` (1.25 x FLA's error: ``tests/lightning_cases.py`` ``bound``). ``missing``
measures only the cases absent from ``tests/lightning_fla_errors.py`` and keeps the ones recorded there (a NaN entry
counts as recorded: it is FLA's result, not a gap). The file is rewritten after every case (a time-capped run keeps
what it measured).

FLA's calls, on exactly the cases' inputs (the same bf16 q/k/v, the same decays):
- prefill: ``fla.ops.simple_gla.chunk_simple_gla(q, k, v, g_gamma=, initial_state=, output_final_state=True,
  state_v_first=, cu_seqlens=int64)``, the kernel FLA's ``chunk_lightning_attn`` runs: that entry forms g_gamma from
  ``(layer_idx, num_layers)`` only and has no ``state_v_first``, so the tests' decays (``GAMMA``) and the v-first
  layout reach FLA's Lightning kernel through it; the layer-decay case calls ``chunk_lightning_attn(layer_idx=,
  num_layers=)`` itself;
- decode: ``fla.ops.simple_gla.fused_recurrent_simple_gla(q, k, v, g_gamma=, initial_state=, output_final_state=True,
  state_v_first=, cu_seqlens=int64)``;
- a pool call in FLA's dense form (FLA 0.6.0 has no state pool): h0 = each sequence's start state gathered from the
  pool (zeros for padding rows and where ``has_initial_state`` is False: ``lightning_cases.start_states``); o of a
  pool call's padding rows set to zero (what the contract gives them) before its error is taken; the state error on the
  slots the call writes, FLA's final states rounded to the pool's dtype against the oracle's pool (as the tests
  measure cuLA's pool).
Errors: rel. L2 against ``lightning_naive`` in float64 (``lightning_cases.oracle``). A non-finite FLA output (FLA's
packed final states were non-finite in one benchmark run) is recorded as NaN, "not measured": the tests fall back,
for that entry only, to the provisional bound (``lightning_cases.PROVISIONAL_BOUND``). FLA appears only here.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

os.environ["FLA_FLASH_KDA"] = "0"
os.environ["FLA_CULA"] = "0"  # (FLA's own kernels, not cuLA through FLA's registry)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests import lightning_cases as lc  # noqa: E402
from tests.helpers import rel_l2  # noqa: E402

NAN = float("nan")


def fla_call(case: lc.LightningCase, kwargs: dict) -> tuple[str, dict]:
    """Which FLA function runs ``case`` (``"lightning"``: ``chunk_lightning_attn``, ``"prefill"``:
    ``chunk_simple_gla``, ``"decode"``: ``fused_recurrent_simple_gla``) and its keyword arguments (the module
    docstring says why each)."""
    cu = kwargs.get("cu_seqlens")
    call = {"q": kwargs["q"], "k": kwargs["k"], "v": kwargs["v"], "initial_state": lc.start_states(case, kwargs),
            "output_final_state": True, "cu_seqlens": None if cu is None else cu.long()}
    if case.layer is not None:
        call["layer_idx"], call["num_layers"] = case.layer
        return "lightning", call
    call["g_gamma"] = kwargs["g_gamma"]
    call["state_v_first"] = case.v_first
    return case.op, call


def fla_functions() -> dict[str, Callable]:
    """FLA 0.6.0's three entries (imported here: FLA_CULA=0 is already set)."""
    from fla.ops.lightning_attn import chunk_lightning_attn
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

    return {"lightning": chunk_lightning_attn, "prefill": chunk_simple_gla, "decode": fused_recurrent_simple_gla}


def _finite_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return rel_l2(out, ref) if torch.isfinite(out).all() else NAN


def case_errors(case: lc.LightningCase, kwargs: dict, o: torch.Tensor, states: torch.Tensor) -> tuple[float, float]:
    """(o's, the states') rel. L2 error of FLA's outputs ``o`` ``[B, T, H, V]`` and final states ``[N, H, ...]``
    against the fp64 oracle, NaN where FLA's values are not finite; ``kwargs["state"]`` must be the untouched
    pool (FLA never writes it)."""
    o_ref, states_ref = lc.oracle(case, kwargs, final_state=True)
    o = o.detach().cpu().double().clone()
    if case.pool:
        starts = lc.bounds_of(None if case.lens is None else list(case.lens), case.B, case.T)
        flat = o.view(case.B * case.T, *o.shape[2:])
        for n, slot in enumerate(case.indices):
            if not 0 <= slot < lc.POOL_SLOTS:
                flat[starts[n]:starts[n + 1]] = 0.0
    err_o = _finite_error(o, o_ref)
    states = states.detach().cpu()
    if case.pool:
        rows = case.written_rows()
        got = torch.stack([states[n].to(case.pool_dtype) for n, _ in rows])
        err_states = _finite_error(got, states_ref[[s for _, s in rows]])
    else:
        err_states = _finite_error(states, states_ref)
    return err_o, err_states


def measure(case: lc.LightningCase, fns: dict[str, Callable], device: torch.device | str) -> tuple[float, float]:
    """FLA's errors on ``case`` (inputs by ``lc.make_inputs(case, device)``, seed 0)."""
    kwargs = lc.make_inputs(case, device)
    which, call = fla_call(case, kwargs)
    o, states = fns[which](**call)
    return case_errors(case, kwargs, o, states)


def _number(x: float) -> str:
    return 'float("nan")' if math.isnan(x) else f"{x:.4e}"


def write_errors(out_path: str, rows: list[tuple[str, float, float]], *, device: str, versions: str,
                 kept: bool) -> None:
    """The frozen table: ``rows`` (name, o error, state error) in a module with the measurement's provenance."""
    note = " (the cases recorded before kept from their own runs)" if kept else ""
    nans = [name for name, eo, eh in rows if math.isnan(eo) or math.isnan(eh)]
    fallback = ""
    if nans:
        fallback = "\n" + textwrap.fill(
            "NaN: FLA's values were not finite on that output (not measured); its bound follows "
            f"tests/lightning_cases.py's rule for NaN entries: {', '.join(nans)}.", width=116, break_on_hyphens=False)
    header = (
        '"""FLA 0.6.0\'s rel. L2 error (o, the states) against the fp64 oracle on '
        "tests/lightning_cases.py (seed 0).\n\n"
        f"Measured by benchmarks/fla_lightning_error_bounds.py on {device}\n"
        f"({versions}, FLA_FLASH_KDA=0, FLA_CULA=0) on {datetime.date.today().isoformat()}{note}.{fallback}\n"
        'Do not edit by hand."""\n\n'
    )
    body = ("LIGHTNING_FLA_ERRORS: dict[str, tuple[float, float]] = {\n"
            + "".join(f"    {name!r}: ({_number(eo)}, {_number(eh)}),\n" for name, eo, eh in rows) + "}\n")
    Path(out_path).write_text(header + body)


def main(out_path: str, only: str = "", fns: dict[str, Callable] | None = None, device: str = "cuda",
         known: dict | None = None) -> list[tuple[str, float, float]]:
    """``only``: case names to measure, or ``missing`` for those absent from tests/lightning_fla_errors.py (``known``
    overrides that table); the file written holds the measured cases plus, with ``missing``, the ones recorded.
    ``fns`` / ``device``: stand-ins for FLA and the GPU (the CPU tests)."""
    if only == "missing" and known is None:
        from tests.lightning_fla_errors import LIGHTNING_FLA_ERRORS as known
    known = dict(known or {}) if only == "missing" else {}
    names = [] if only in ("", "missing") else only.split(",")
    unknown = [name for name in names if name not in lc.BY_NAME]
    if unknown:
        raise ValueError(f"only names unknown cases {unknown}; the cases are tests/lightning_cases.py CASES")
    if fns is None:
        import fla

        fns, versions = fla_functions(), f"torch {torch.__version__}, fla-core {fla.__version__}"
        device_name = torch.cuda.get_device_name()
    else:
        versions, device_name = f"torch {torch.__version__}, stand-in contenders", str(device)
    rows = [(name, float(eo), float(eh)) for name, (eo, eh) in known.items()]
    for case in lc.CASES:
        if case.name in known or (names and case.name not in names):
            continue
        err_o, err_states = measure(case, fns, device)
        rows.append((case.name, err_o, err_states))
        print(f"{case.name:48s} o {err_o:.3e}  states {err_states:.3e}", flush=True)
        write_errors(out_path, rows, device=device_name, versions=versions, kept=bool(known))
    if len(rows) == len(known):
        print("no case to measure: every case asked for is recorded already", flush=True)
    return rows


if __name__ == "__main__":
    main(*sys.argv[1:3])
