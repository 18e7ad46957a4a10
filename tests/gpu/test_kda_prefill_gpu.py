"""kda_prefill on each GPU backend (forced with CULA_BACKEND) against the fp64 oracle, on the H200.

Bounds: 1.25 x the error FLA's Triton chunk_kda makes on the same inputs (measured on the H200, frozen in
tests/kda_fla_errors.py for every case), never above 1e-2. Outputs are poisoned (NaN-filled allocator blocks)
before each run. Per-case errors are appended to $CULA_ERROR_LOG.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_backends import BACKENDS, check_against_oracle, poison_allocator, use_backend
from tests.kda_cases import CASES, PENDING_FLA_CASES, UNBOUNDED_CASES, make_inputs

pytestmark = pytest.mark.gpu
ALL_CASES = [*CASES, *UNBOUNDED_CASES]  # the safe gate's matrix, then every unbounded gate form (issue 25)


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_oracle_within_fla_bound(backend: str, case, monkeypatch: pytest.MonkeyPatch) -> None:
    from cula.kda import kda_prefill

    use_backend(backend, monkeypatch)
    kwargs = make_inputs(case, "cuda", seed=0)
    poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
    o, ht = kda_prefill(**kwargs)
    torch.cuda.synchronize()
    check_against_oracle(backend, case, kwargs, o, ht)


@pytest.mark.parametrize("name", ["varlen-0-1-64-65-200", "kimi-nodtbias-varlen-tails", "extreme-B1-T700-H2"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_1000_replays_are_bit_identical(backend: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cula.kda import kda_prefill

    use_backend(backend, monkeypatch)
    kwargs = make_inputs(next(c for c in [*ALL_CASES, *PENDING_FLA_CASES] if c.name == name), "cuda", seed=1)
    o0, ht0 = kda_prefill(**kwargs)
    for _ in range(1000):
        o, ht = kda_prefill(**kwargs)
        assert torch.equal(o, o0) and torch.equal(ht, ht0)


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.name for c in ALL_CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_planned_calls_give_the_bits_of_the_first(backend: str, case, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's first run is validated and dispatched and leaves a call plan (cula.call_plans), which runs it; it
    and the next calls of its signature, on new tensors of the same values, into poisoned memory, give the bits of
    the call made without plans (``CULA_CALL_PLANS=0``), and the plan was used (the validator did not run again)."""
    import cula.kda
    from cula import call_plans
    from cula_runtime.kda_args import validate_kda_prefill

    use_backend(backend, monkeypatch)
    kwargs = make_inputs(case, "cuda", seed=11)
    monkeypatch.setenv(call_plans.ENV_CALL_PLANS, "0")
    o_unplanned, ht_unplanned = cula.kda.kda_prefill(**kwargs)
    monkeypatch.delenv(call_plans.ENV_CALL_PLANS)
    assert not call_plans._plans
    o_ref, ht_ref = cula.kda.kda_prefill(**kwargs)
    assert len(call_plans._plans) == 1, f"the {backend} backend made no plan"
    assert torch.equal(o_ref, o_unplanned) and (ht_ref is None or torch.equal(ht_ref, ht_unplanned))
    validations = []
    monkeypatch.setattr(cula.kda, "validate_kda_prefill",
                        lambda *a: validations.append(1) or validate_kda_prefill(*a))
    for _ in range(2):
        poison_allocator(4 * o_ref.numel() * o_ref.element_size())
        fresh = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
        o, ht = cula.kda.kda_prefill(**fresh)
        assert torch.equal(o, o_ref) and (ht_ref is None or torch.equal(ht, ht_ref))
    assert validations == []
