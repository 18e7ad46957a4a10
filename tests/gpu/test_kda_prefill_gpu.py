"""kda_prefill on each GPU backend (forced with CULA_BACKEND) against the fp64 oracle, on the H200.

Bounds: 1.25 x the error FLA's Triton chunk_kda makes on the same inputs (measured on the H200, frozen in
tests/kda_fla_errors.py for every case), never above 1e-2. Outputs are poisoned (NaN-filled allocator blocks)
before each run. Per-case errors are appended to $CULA_ERROR_LOG.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_backends import BACKENDS, check_against_oracle, poison_allocator, use_backend
from tests.kda_cases import CASES, make_inputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_oracle_within_fla_bound(backend: str, case, monkeypatch: pytest.MonkeyPatch) -> None:
    from cula.kda import kda_prefill

    use_backend(backend, monkeypatch)
    kwargs = make_inputs(case, "cuda", seed=0)
    poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
    o, ht = kda_prefill(**kwargs)
    torch.cuda.synchronize()
    check_against_oracle(backend, case, kwargs, o, ht)


@pytest.mark.parametrize("backend", BACKENDS)
def test_1000_replays_are_bit_identical(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from cula.kda import kda_prefill

    use_backend(backend, monkeypatch)
    kwargs = make_inputs(next(c for c in CASES if c.name == "varlen-0-1-64-65-200"), "cuda", seed=1)
    o0, ht0 = kda_prefill(**kwargs)
    for _ in range(1000):
        o, ht = kda_prefill(**kwargs)
        assert torch.equal(o, o0) and torch.equal(ht, ht0)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
@pytest.mark.parametrize("backend", BACKENDS)
def test_planned_calls_give_the_bits_of_the_first(backend: str, case, monkeypatch: pytest.MonkeyPatch) -> None:
    """A call's first run is validated and dispatched and leaves a call plan (cula.call_plans); the next calls of
    its signature run the plan, on new tensors of the same values, into poisoned memory: the same bits, and the plan
    was used (the validator did not run again)."""
    import cula.kda
    from cula import call_plans
    from cula_runtime.kda_args import validate_kda_prefill

    use_backend(backend, monkeypatch)
    kwargs = make_inputs(case, "cuda", seed=11)
    o_ref, ht_ref = cula.kda.kda_prefill(**kwargs)
    assert len(call_plans._plans) == 1, f"the {backend} backend made no plan"
    validations = []
    monkeypatch.setattr(cula.kda, "validate_kda_prefill",
                        lambda *a: validations.append(1) or validate_kda_prefill(*a))
    for _ in range(2):
        poison_allocator(4 * o_ref.numel() * o_ref.element_size())
        fresh = {name: x.clone() if isinstance(x, torch.Tensor) else x for name, x in kwargs.items()}
        o, ht = cula.kda.kda_prefill(**fresh)
        assert torch.equal(o, o_ref) and (ht_ref is None or torch.equal(ht, ht_ref))
    assert validations == []


@pytest.mark.parametrize("variant", ["wide", "lean", "fused", "lean-unrolled-prefetch", "fused-prefetch",
                                     "lean-unrolled-8warps", "lean-unrolled-prefetch-8warps", "fused-prefetch-8warps"])
@pytest.mark.parametrize("case_name", ["B2-T257-H2-vk", "varlen-3seqs-h0bf16-GVA4", "B1-T300-H2-no-l2norm"])
def test_cutedsl_intra_variants_give_the_same_bits(variant: str, case_name: str, monkeypatch) -> None:
    """Every CuTeDSL intra variant (shared-memory plan, loop or unrolled inverse, the L2 norm moved from kda_prepare
    into the intra kernel, loads issued a row pass ahead, 8 warps) gives the lean-unrolled pipeline's o and final
    state bit for bit (the pipeline checked against fp64 on the H200 before the fused-prepare default)."""
    from cula.kda import kda_prefill

    use_backend("cutedsl", monkeypatch)
    kwargs = make_inputs(next(c for c in CASES if c.name == case_name), "cuda", seed=5)
    monkeypatch.setenv("CULA_CUTE_INTRA", "lean-unrolled")
    o0, ht0 = kda_prefill(**kwargs)
    monkeypatch.setenv("CULA_CUTE_INTRA", variant)
    o, ht = kda_prefill(**kwargs)
    assert torch.equal(o, o0) and torch.equal(ht, ht0)


@pytest.mark.parametrize("case_name", [
    "B2-T257-H2-vk", "B2-T1000-H4-betabf16", "B1-T700-H2-HV8", "B1-T300-H2-gate-precomputed",
    "B1-T300-H2-gate-precomputed-bf16", "B1-T300-H2-rawgate-bf16", "B1-T300-H2-no-l2norm",
    "B1-T300-H2-beta-activated-bf16", "varlen-0-1-64-65-200", "varlen-0-0-70", "varlen-3seqs-h0bf16-GVA4",
])
@pytest.mark.parametrize("variant", ["fused-prepare", "fused-prepare-prefetch", "fused-prepare-prefetch-8warps"])
def test_cutedsl_fused_prepare_gives_the_same_bits(case_name: str, variant: str, monkeypatch) -> None:
    """The fused-prepare variants (kda_prepare's gate cumsum, β and L2 norm inside the intra kernel; the recurrence
    reads the intra kernel's per-chunk decay rows; the last is the default) give the lean-unrolled pipeline's o and
    final state bit for bit, over the gate forms, input dtypes, GVA, varlen with empty and one-token sequences."""
    from cula.kda import kda_prefill

    use_backend("cutedsl", monkeypatch)
    kwargs = make_inputs(next(c for c in CASES if c.name == case_name), "cuda", seed=6)
    monkeypatch.setenv("CULA_CUTE_INTRA", "lean-unrolled")
    o0, ht0 = kda_prefill(**kwargs)
    monkeypatch.setenv("CULA_CUTE_INTRA", variant)
    poison_allocator(8 * o0.numel() * 2)
    o, ht = kda_prefill(**kwargs)
    assert torch.equal(o, o0)
    assert (ht is None and ht0 is None) or torch.equal(ht, ht0)

