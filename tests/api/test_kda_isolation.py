"""Sequences never read each other: NaN in one sequence (inputs and initial state) leaves every other sequence's
output and final state bit-identical, on every backend. A kernel whose tail-chunk or varlen loads cross a sequence
boundary, or that mixes rows of a batch, turns its neighbours' results into NaN or changes their bits.

The reference backend runs on the CPU (CI); the GPU backends are marked ``gpu``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.gpu_backends import BACKENDS, use_backend
from tests.kda_cases import KdaCase, make_inputs

# lengths 100 (tail), 77 (the poisoned one, tail), 130, 0 (empty), 64 (exact chunk), 1
VARLEN = KdaCase("isolation-varlen", B=1, T=372, H=2, HV=4, cu=(0, 100, 177, 307, 307, 371, 372))
FIXED = KdaCase("isolation-fixed", B=3, T=150, H=2, HV=4)
PER_TOKEN = ("q", "k", "v", "g", "beta")


def _poison(kwargs: dict, case: KdaCase, victim: int) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A copy of ``kwargs`` with sequence ``victim`` NaN everywhere it has inputs; also the masks of the other
    sequences' tokens ``[B, T]`` and of the other sequences ``[N]``."""
    poisoned = {name: (x.clone() if isinstance(x, torch.Tensor) else x) for name, x in kwargs.items()}
    tokens = torch.zeros(case.B, case.T, dtype=torch.bool)
    if case.cu is None:
        tokens[victim] = True
    else:
        tokens[0, case.cu[victim]:case.cu[victim + 1]] = True
    device = kwargs["q"].device
    for name in PER_TOKEN:
        poisoned[name][tokens.to(device)] = float("nan")
    poisoned["initial_state"][victim] = float("nan")
    N = case.B if case.cu is None else len(case.cu) - 1
    others = torch.ones(N, dtype=torch.bool)
    others[victim] = False
    return poisoned, ~tokens, others


def _check_isolation(case: KdaCase, victim: int, device: str) -> None:
    from cula.kda import kda_prefill

    kwargs = make_inputs(case, device, seed=3)
    o, ht = kda_prefill(**kwargs)
    poisoned, tokens, others = _poison(kwargs, case, victim)
    o_p, ht_p = kda_prefill(**poisoned)
    o, o_p, ht, ht_p = (x.cpu() for x in (o, o_p, ht, ht_p))
    assert torch.isfinite(o[tokens]).all() and torch.isfinite(ht[others]).all()
    assert torch.equal(o_p[tokens], o[tokens]), "another sequence's output changed"
    assert torch.equal(ht_p[others], ht[others]), "another sequence's final state changed"
    assert torch.isnan(o_p[~tokens]).all(), "the poisoned sequence must come out NaN (else the test proves nothing)"


@pytest.mark.parametrize("case,victim", [(VARLEN, 1), (VARLEN, 5), (FIXED, 1)], ids=["varlen-1", "varlen-last",
                                                                                  "fixed-row-1"])
def test_reference_backend_isolates_sequences(case: KdaCase, victim: int, monkeypatch) -> None:
    monkeypatch.setenv("CULA_BACKEND", "reference")
    _check_isolation(case, victim, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("case,victim", [(VARLEN, 1), (VARLEN, 5), (VARLEN, 0), (FIXED, 1)],
                         ids=["varlen-1", "varlen-last", "varlen-first", "fixed-row-1"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_backend_isolates_sequences(backend: str, case: KdaCase, victim: int, monkeypatch) -> None:
    use_backend(backend, monkeypatch)
    _check_isolation(case, victim, "cuda")


def test_cases_cover_tails_empty_and_exact_chunks() -> None:
    lengths = [b - a for a, b in itertools.pairwise(VARLEN.cu)]
    assert 0 in lengths and 64 in lengths and 1 in lengths and any(n % 64 for n in lengths if n > 64)
    assert FIXED.T % 64
