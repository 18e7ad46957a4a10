"""The fused form of the Lightning prefill (one launch: ``chunk_output``'s ``fused=True``, through
``prefill_backend.lightning_prefill_cutedsl_backend(..., fused=True)``) on a GPU, beside the three-launch form.

The two forms round differently in one place only: the fused form makes each segment's own state with the output
pass's chunk step (``S = λ^64 S + bf16(λ^(63-j) v_j)ᵀ k_j`` per chunk, the last chunk with its own length), kernel
A with decays measured from the segment's end. So the check is against the float64 recurrence
(``lightning_naive``): the fused form's rel-L2 error on o and on the final states or pool slots at most 1.25x the
three-launch form's on the same inputs, plus 1e-7 (the project's bar, taken against a form that is itself within
1.25x FLA's own error; the public API's cases also run on the fused form against FLA's frozen errors in
``tests/gpu/test_lightning_gpu.py``). A wrong start state or a missed segment shows as errors orders larger.
Segments are forced short (``seg_len`` 64 or 128) so that sequences have more segments than the look-back window
(4): the start states then come from an earlier segment's end state, not the sequence's. Outputs are NaN-poisoned
first.

``test_fused_replays_are_bit_identical``: the look-back's result does not depend on the order the CTAs run in
(``segment_start``): 200 replays of a call whose sequences have up to 64 segments, the same bits every time.
"""

from __future__ import annotations

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.lightning_args import validate_lightning_prefill
from cula_runtime.reference.lightning import lightning_naive
from tests.gpu_backends import poison_allocator
from tests.helpers import rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cula_cute.is_available(),
                       reason="CuTeDSL or TVM-FFI is missing (cula-runtime brings them on Linux x86_64/aarch64)"),
]

K = 128


def _inputs(lens: list[int], H: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(1, T, H, K, generator=gen).to(torch.bfloat16).cuda() for _ in range(3))
    g_gamma = (-torch.rand(H, generator=gen) * 0.3).cuda()
    g_gamma[0] = 0.0  # no decay: the states grow over the whole sequence
    if H > 1:
        g_gamma[-1] = -8.0  # a decay that empties the state within a token
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    return q, k, v, g_gamma, cu


def _run(args, fused: bool, seg_len: int):
    from cula_runtime.cute.lightning import prefill_backend

    poison_allocator(8 * args.q.numel() * 4)
    out = prefill_backend.lightning_prefill_cutedsl_backend(args, seg_len=seg_len, fused=fused)
    torch.cuda.synchronize()
    return out


CASES = [
    pytest.param([1000], 2, 64, "h0", id="B1-T1000-H2-seg64-h0"),
    pytest.param([4096], 3, 64, "none", id="B1-T4096-H3-seg64-rank63"),
    pytest.param([0, 700, 1, 0, 2000, 129], 4, 128, "h0-vfirst", id="varlen-empty-seg128-h0-vfirst"),
    pytest.param([300, 64, 65], 2, 64, "pool-fp32", id="varlen-seg64-pool-fp32"),
    pytest.param([513, 0, 1200], 2, 64, "pool-bf16-flags", id="varlen-empty-seg64-pool-bf16-flags"),
    pytest.param([3000, 3000], 16, 0, "h0", id="B2-T3000-H16-chosen-seg_len"),
]


@pytest.mark.parametrize(("lens", "H", "seg_len", "states"), CASES)
def test_fused_matches_fp64_as_the_three_launches_do(lens: list[int], H: int, seg_len: int, states: str) -> None:
    q, k, v, g_gamma, cu = _inputs(lens, H, seed=sum(lens) + H)
    N = len(lens)
    v_first = states.endswith("vfirst")
    kwargs = dict(cu_seqlens=cu, state_v_first=v_first)
    h0 = None
    if states.startswith("h0"):
        h0 = torch.randn(N, H, K, K, device="cuda") * 0.1
        kwargs.update(initial_state=h0, output_final_state=True)
    pool0 = None
    if states.startswith("pool"):
        dtype = torch.bfloat16 if "bf16" in states else torch.float32
        P = N + 3
        pool0 = (torch.randn(P, H, K, K, device="cuda") * 0.1).to(dtype)
        slots = torch.tensor([(2 * n + 1) % P for n in range(N)], dtype=torch.int32, device="cuda")
        slots[-1] = -1  # padding: nothing read or written
        kwargs.update(state_indices=slots)
        if "flags" in states:
            kwargs["has_initial_state"] = torch.tensor([n % 2 == 0 for n in range(N)], device="cuda")
    if states == "none":
        kwargs["output_final_state"] = True

    results = {}
    for fused in (False, True):
        call = dict(kwargs)
        if pool0 is not None:
            call["state"] = pool0.clone()
        args = validate_lightning_prefill(q, k, v, g_gamma, **call)
        o, ht = _run(args, fused, seg_len)
        assert torch.isfinite(o).all()
        results[fused] = (o, ht if pool0 is None else call["state"])

    # the fp64 oracle: each sequence from its start state (h0, its pool slot read where its flag allows, or zeros)
    start = h0
    if pool0 is not None:
        slots = kwargs["state_indices"].tolist()
        flags = kwargs.get("has_initial_state")
        start = torch.zeros(N, H, K, K, device="cuda")
        for n, slot in enumerate(slots):
            if slot >= 0 and (flags is None or bool(flags[n])):
                start[n] = pool0[slot].float()
    o_ref, ht_ref = lightning_naive(q.cpu(), k.cpu(), v.cpu(), g_gamma.cpu(), None,
                                    initial_state=None if start is None else start.cpu(), output_final_state=True,
                                    cu_seqlens=cu.cpu(), state_v_first=v_first)
    errors = {}
    for fused, (o, states_out) in results.items():
        err_o = rel_l2(o.cpu(), o_ref)
        if pool0 is None:
            err_s = rel_l2(states_out.cpu(), ht_ref) if states_out is not None else 0.0
        else:
            written = [n for n, slot in enumerate(slots) if slot >= 0]
            err_s = rel_l2(states_out[[slots[n] for n in written]].float().cpu(), ht_ref[written])
            untouched = [p for p in range(pool0.shape[0]) if p not in slots]
            assert torch.equal(states_out[untouched], pool0[untouched]), "a slot no sequence names changed"
        errors[fused] = (err_o, err_s)
    print(f"rel-L2 (o, states): three launches {errors[False]}, fused {errors[True]}")
    for fused_err, three_err in zip(errors[True], errors[False], strict=True):
        assert fused_err <= 1.25 * three_err + 1e-7, errors


def test_fused_replays_are_bit_identical() -> None:
    lens = [4096, 0, 2500, 64, 1]
    q, k, v, g_gamma, cu = _inputs(lens, 4, seed=7)
    args = validate_lightning_prefill(q, k, v, g_gamma, cu_seqlens=cu, output_final_state=True)
    first_o, first_ht = _run(args, True, 64)
    for _ in range(200):
        o, ht = _run(args, True, 64)
        assert torch.equal(o, first_o) and torch.equal(ht, first_ht)
