"""Helpers of the GPU backend tests: forcing a backend, the frozen error bounds, poisoning the allocator."""

from __future__ import annotations

import importlib.util

import pytest
import torch

BACKENDS = ("sm90", "cutedsl")
FLA_FACTOR = 1.25
CEILING = 1e-2


def use_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force ``backend`` for this test, or skip when it is not installed here."""
    if backend == "sm90":
        if importlib.util.find_spec("cula_sm90") is None:
            pytest.skip("cula-sm90 is not installed")
        import cula_sm90

        try:
            cula_sm90.load_extension()
        except ImportError as error:
            pytest.skip(f"cula_sm90 extension not loadable: {error}")
        if torch.cuda.get_device_capability() != (9, 0):
            pytest.skip("cula-sm90 needs an SM90 GPU")
    else:
        from cula_runtime.cute import is_available

        if not is_available():
            pytest.skip("CuTeDSL / TVM-FFI not installed")
    monkeypatch.setenv("CULA_BACKEND", backend)


def _fla_errors() -> dict:
    try:
        from tests.kda_fla_errors import FLA_ERRORS
    except ImportError:
        return {}
    return FLA_ERRORS


def bound(name: str, which: int) -> float:
    """The accepted rel. L2 error of output ``which`` (0: o, 1: final state) on case ``name``."""
    errors = _fla_errors()
    if name not in errors:  # a new case needs FLA's error first: benchmarks/fla_error_bounds.py ... missing
        raise KeyError(f"no FLA error recorded for case {name!r} in tests/kda_fla_errors.py")
    return min(FLA_FACTOR * errors[name][which], CEILING)


def poison_allocator(nbytes: int) -> None:
    """Fill free blocks of the caching allocator with NaN so unwritten outputs show up."""
    block = torch.full((max(nbytes, 1 << 20) // 4,), float("nan"), device="cuda")
    del block


def check_against_oracle(label: str, case, kwargs: dict, o: torch.Tensor, ht: torch.Tensor | None,
                         note: str = "") -> None:
    """o (and the final state when the case asks for it) against the fp64 oracle on the same inputs, within the
    frozen bounds of ``case``; one line per call appended to $CULA_ERROR_LOG (``label``, the errors, ``note``)."""
    import os

    from tests.helpers import rel_l2
    from tests.kda_cases import oracle

    assert o.dtype == torch.bfloat16 and torch.isfinite(o).all(), "o has unwritten or non-finite entries"
    o_ref, ht_ref = oracle(kwargs)
    err_o = rel_l2(o.cpu(), o_ref)
    err_ht = rel_l2(ht.cpu(), ht_ref) if case.final_state else 0.0
    if os.environ.get("CULA_ERROR_LOG"):
        with open(os.environ["CULA_ERROR_LOG"], "a") as log:
            known = case.name in _fla_errors()  # (a case without FLA's error yet is logged, then fails below)
            bounds = (bound(case.name, 0), bound(case.name, 1)) if known else (float("nan"), float("nan"))
            log.write(f"{label} {case.name} o {err_o:.4e} ht {err_ht:.4e} bound_o {bounds[0]:.4e} "
                      f"bound_ht {bounds[1]:.4e}{' ' + note if note else ''}\n")
    assert err_o <= bound(case.name, 0), f"o error {err_o:.3e}"
    if case.final_state:
        assert ht.dtype == torch.float32 and torch.isfinite(ht).all()
        assert err_ht <= max(bound(case.name, 1), 1e-6), f"final state error {err_ht:.3e}"
    else:
        assert ht is None
