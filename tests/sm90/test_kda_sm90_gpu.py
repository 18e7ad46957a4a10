"""The native SM90 KDA kernels on the H200: what is particular to them (block sizes, the workspace between the two
kernels, dispatch, what verify rejects). Accuracy and determinism of kda_prefill: tests/gpu/test_kda_prefill_gpu.py.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from cula_runtime.kda_args import validate_kda_prefill
from tests.gpu_backends import check_against_oracle, poison_allocator, use_backend
from tests.helpers import rel_l2
from tests.kda_cases import CASES, KdaCase, make_inputs

pytestmark = pytest.mark.gpu


def _sm90(monkeypatch: pytest.MonkeyPatch):
    use_backend("sm90", monkeypatch)
    from cula_sm90 import kda

    return kda


def _run(kda, args, **knobs) -> tuple:
    """``kda.run_kernels(args, **knobs)`` with the workspace's Aqk blocks above the diagonal set to zero: the intra
    kernel writes only the 16 x 16 blocks on and below it (the recurrence zero-fills the others in shared memory), so
    the rest of that region is whatever the allocator left there."""
    o, ht, ws = kda.run_kernels(args, **knobs)
    if "Aqk" in ws:
        local = torch.cat([torch.arange(n) for n in _lengths(args)]) % 64  # each token's row in its chunk
        written = (torch.arange(64) // 16)[None, :] <= (local // 16)[:, None]  # [Ttot, 64]
        ws["Aqk"] = torch.where(written[:, None, :].to(ws["Aqk"].device), ws["Aqk"], 0)
    return o, ht, ws


@pytest.mark.parametrize("name", ["varlen-6seqs-GVA2-vk", "varlen-3seqs-h0bf16-GVA4", "varlen-0-1-64-65-200"])
def test_warpgroup_block_sizes_give_the_same_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warpgroup-MMA recurrence at V blocks of 64 and 128 (the same instructions per warpgroup, over 2 or 1 CTAs
    per head) gives the same o and final state bit for bit; varlen cases, launched longest first."""
    kda = _sm90(monkeypatch)
    case = next(c for c in CASES if c.name == name)
    args = validate_kda_prefill(**make_inputs(case, "cuda", seed=9))
    o_ref, ht_ref, _ = _run(kda, args, block_v=64)
    o, ht, _ = _run(kda, args, block_v=128)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


def _assert_same_bits(got: tuple, ref: tuple, context: object) -> None:
    """Two ``run_kernels`` results (o, final state or None, workspace) equal bit for bit; ``context`` names the run
    in the failure message."""
    (o, ht, ws), (o_ref, ht_ref, ws_ref) = got, ref
    assert torch.equal(o, o_ref), context
    assert (ht is None and ht_ref is None) or torch.equal(ht, ht_ref), context
    for key, value in ws_ref.items():
        assert torch.equal(ws[key], value), (context, key)


@pytest.mark.parametrize("block_v", [64, 128])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_recurrence_matches_oracle(case: KdaCase, block_v: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recurrence at each V block (64 and 128: warpgroup MMAs): o and the final state within the frozen FLA
    bounds against fp64 on every case, outputs poisoned first; the intra workspace untouched; close to the V block of
    64 (whether the bits are equal goes to $CULA_ERROR_LOG; test_warpgroup_block_sizes_give_the_same_bits requires
    it on three varlen cases); the same bits over 10 replays."""
    kda = _sm90(monkeypatch)
    kwargs = make_inputs(case, "cuda", seed=0)
    args = validate_kda_prefill(**kwargs)
    o_ref, ht_ref, ws_ref = _run(kda, args, block_v=64)
    poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
    o, ht, ws = _run(kda, args, block_v=block_v)
    torch.cuda.synchronize()
    for key, ref in ws_ref.items():
        assert torch.equal(ws[key], ref), key
    same = torch.equal(o, o_ref) and (ht is None or torch.equal(ht, ht_ref))
    check_against_oracle(f"sm90-recurrence-bv{block_v}", case, kwargs, o, ht, note=f"bits_equal_bv64 {same}")
    assert rel_l2(o.float().cpu(), o_ref.float().cpu()) <= 1e-2
    for _ in range(10):
        o2, ht2, _ = _run(kda, args, block_v=block_v)
        assert torch.equal(o2, o) and (ht is None or torch.equal(ht2, ht))


@pytest.mark.parametrize("name", ["B2-T1000-H4-betabf16", "B1-T700-H2-HV8", "varlen-6seqs-GVA2-vk",
                                  "varlen-0-1-64-65-200"])
def test_programmatic_launch_gives_the_same_bits(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recurrence launched as a programmatic dependent of the intra kernel (CULA_SM90_PDL=1; "auto", the
    default, does so for these cases) gives the bits of the plain stream-ordered launch (CULA_SM90_PDL=0): workspace,
    o and final state, outputs poisoned first, over 5 replays; and captured in a CUDA graph (fixed-length cases), each
    replay into NaN-filled outputs gives them again."""
    kda = _sm90(monkeypatch)
    case = next(c for c in CASES if c.name == name)
    args = validate_kda_prefill(**make_inputs(case, "cuda", seed=21))
    monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "0")
    ref = _run(kda, args)
    monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "1")
    for replay in range(5):
        poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
        _assert_same_bits(_run(kda, args), ref, replay)
    if args.cu_seqlens is not None:
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (warm-up off the capturing stream, as torch asks)
        kda.kda_prefill(args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, ht = kda.kda_prefill(args)
    for _ in range(3):
        o.fill_(float("nan"))
        if ht is not None:
            ht.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, ref[0]) and (ht is None or torch.equal(ht, ref[1]))


@pytest.mark.parametrize("form", ["tensor", "bands", "unbounded"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_intra_tuned_matches_oracle(case: KdaCase, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each intra form, forced (CULA_SM90_INTRA_TUNED: "tensor", the inverse's products as bf16x3 tensor-core MMAs;
    "bands", the same computing only the 16-row bands that hold tokens; "unbounded", the form every unbounded-gate
    call runs, here on the bounded cases): o and the final state within the frozen FLA bounds against fp64, outputs
    poisoned first; the same bits over 5 replays."""
    kda = _sm90(monkeypatch)
    kwargs = make_inputs(case, "cuda", seed=0)
    args = validate_kda_prefill(**kwargs)
    poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
    o, ht, _ = _run(kda, args, intra_tuned=form)
    torch.cuda.synchronize()
    check_against_oracle(f"sm90-intra-tuned-{form}", case, kwargs, o, ht)
    for _ in range(5):
        o2, ht2, _ = _run(kda, args, intra_tuned=form)
        assert torch.equal(o2, o) and (ht is None or torch.equal(ht2, ht))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bands_form_gives_the_tensor_forms_bits(case: KdaCase, monkeypatch: pytest.MonkeyPatch) -> None:
    """The intra form "bands" computes only the 16-row bands of a chunk that hold valid rows; every valid
    row's arithmetic is that of "tensor" (the bands it skips feed no valid row), so o, the final state and every
    written workspace value are the same bits. Each run follows one on NaN inputs, so that the shared memory the
    skipped bands leave unwritten holds NaN from the previous grid (not guaranteed, the usual case): were any of it
    to reach a valid row, the bits would differ."""
    kda = _sm90(monkeypatch)
    kwargs = make_inputs(case, "cuda", seed=21)
    args = validate_kda_prefill(**kwargs)
    nan_args = validate_kda_prefill(**{key: value.clone().fill_(float("nan")) if key in ("q", "k", "v", "g") else value
                                       for key, value in kwargs.items()})
    ref = _run(kda, args, intra_tuned="tensor")
    poison_allocator(8 * case.B * case.T * case.HV * 128 * 2)
    _run(kda, nan_args, intra_tuned="bands")
    _assert_same_bits(_run(kda, args, intra_tuned="bands"), ref, case.name)
    _run(kda, nan_args, intra_tuned="bands")
    _assert_same_bits(_run(kda, args, intra_tuned="tensor"), ref, (case.name, "tensor after NaN inputs"))


def _lengths(args) -> list[int]:
    """Each sequence's length, from validated kda_prefill arguments."""
    if args.cu_seqlens is None:
        return [args.T] * args.B
    cu = args.cu_seqlens.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]


@pytest.mark.parametrize("name", ["varlen-6seqs-GVA2-vk", "varlen-3seqs-h0bf16-GVA4"])
def test_varlen_with_cu_seqlens_cpu_never_synchronises(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """kda_prefill with a fresh cu_seqlens on every call and its host copy as cu_seqlens_cpu runs without one
    synchronisation (torch's sync debug mode raises on any), and gives the bits of the call without the copy; a
    fresh cu_seqlens without the copy does synchronise (once, to check it), so the test can tell."""
    from cula.kda import kda_prefill

    _sm90(monkeypatch)
    case = next(c for c in CASES if c.name == name)
    kwargs = make_inputs(case, "cuda", seed=3)
    o_ref, ht_ref = kda_prefill(**kwargs)
    cpu = kwargs["cu_seqlens"].cpu()
    torch.cuda.synchronize()
    try:
        torch.cuda.set_sync_debug_mode("error")
        for _ in range(3):
            o, ht = kda_prefill(**{**kwargs, "cu_seqlens": kwargs["cu_seqlens"].clone()}, cu_seqlens_cpu=cpu)
        with pytest.raises(RuntimeError, match="synchroniz"):
            kda_prefill(**{**kwargs, "cu_seqlens": kwargs["cu_seqlens"].clone()})
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(o, o_ref) and (ht_ref is None or torch.equal(ht, ht_ref))
    # What the sync debug mode cannot see (the driver may stage a pageable host-to-device copy synchronously): with
    # ~0.5 s of GPU work queued ahead, the call must return while that work still runs.
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    queued = torch.cuda.Event()
    queued.record()
    o, ht = kda_prefill(**{**kwargs, "cu_seqlens": kwargs["cu_seqlens"].clone()}, cu_seqlens_cpu=cpu)
    assert not queued.query(), "kda_prefill with cu_seqlens_cpu waited for the work queued before it"
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and (ht_ref is None or torch.equal(ht, ht_ref))


def test_varlen_launch_values_equal_the_runtime_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension's C++ build of the varlen index buffer (what a new cu_seqlens costs on the host) gives the
    runtime's chunk indices, chunk offsets and longest-first order, in its buffer layout; random batches with empty
    and 1-token sequences, up to 5000 sequences; decreasing boundaries and a short buffer are ValueErrors. (Host code
    only: it runs wherever the extension loads; marked gpu because only the GPU machine has the built extension.)"""
    from cula_runtime.index import prepare_varlen_launch

    kda = _sm90(monkeypatch)
    ext = kda.load_extension()
    gen = torch.Generator().manual_seed(8)
    for trial, (count, longest) in enumerate([(1, 300), (7, 64), (40, 700), (300, 6000), (5000, 130)] * 3):
        lens = torch.randint(0, longest, (count,), generator=gen)
        lens[trial % count] = trial % 2
        host = torch.tensor([0, *torch.cumsum(lens, 0).tolist()], dtype=torch.int32)
        n, total = count, int(host[-1])
        capacity = ext.varlen_launch_capacity(n, total, 64)
        out = torch.full((capacity,), -7, dtype=torch.int32)
        nt, offsets_at, order_at, size = ext.varlen_launch_values(host.data_ptr(), n, 64, out.data_ptr(), capacity)
        indices, offsets, order = prepare_varlen_launch(host.clone(), 64, host=host)
        base = indices.untyped_storage().data_ptr()
        assert (offsets_at, order_at) == ((offsets.data_ptr() - base) // 4, (order.data_ptr() - base) // 4)
        assert nt == indices.shape[0] and size == order_at + n <= capacity
        assert torch.equal(out[:2 * nt].view(nt, 2), indices)
        assert torch.equal(out[offsets_at:offsets_at + n + 1], offsets) and torch.equal(out[order_at:size], order)
        assert bool((out[size:] == -7).all())  # nothing written past the layout
        tails = lens % 64  # the "auto" intra form's count: 16-row bands without a token in the partial last chunks
        assert ext.varlen_idle_bands(host.data_ptr(), n, 64) == int(((64 - tails) // 16 * (tails > 0)).sum())
    bad = torch.tensor([0, 5, 3], dtype=torch.int32)
    out = torch.empty(64, dtype=torch.int32)
    with pytest.raises(ValueError, match="decreasing boundaries"):
        ext.varlen_launch_values(bad.data_ptr(), 2, 64, out.data_ptr(), 64)
    assert ext.varlen_idle_bands(bad.data_ptr(), 2, 64) == -1
    good = torch.tensor([0, 640], dtype=torch.int32)
    with pytest.raises(ValueError, match="too small"):
        ext.varlen_launch_values(good.data_ptr(), 1, 64, out.data_ptr(), 8)


def test_recurrence_entry_rejects_bad_scalars_before_any_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension's recurrence entry checks its scalars before it launches (null pointers everywhere: a launch would
    fault): a negative token count, a V block other than 64/128 (32 included: the retired mma.sync width; 0 too: the
    shim always resolves it)."""
    ext = _sm90(monkeypatch).load_extension()

    def call(num_tokens: int = 64, block_v: int = 64) -> int:
        # (qg, kg, w, u, Aqk, g_last, cu_seqlens, chunk_offsets, seq_order, h0, state code, final state, o, N, HV,
        # scale, state_v_first, block_v, programmatic launch, num_tokens, stream)
        return ext.kda_recurrence(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1.0, False, block_v, False, num_tokens,
                                  0)

    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        call(num_tokens=-1)
    for bad in (0, 32, 48, 256):
        with pytest.raises(ValueError, match=f"block_v must be 64 or 128, got {bad}"):
            call(block_v=bad)


def test_intra_entry_refuses_the_retired_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    """The extension builds the intra forms "tensor" (11), "bands" (15) and "unbounded" (4107) only: the retired codes
    0-3 (and any other) are ValueErrors naming the built ones, before any launch (null pointers: a launch would
    fault)."""
    ext = _sm90(monkeypatch).load_extension()
    assert ext.intra_form_built(11) and ext.intra_form_built(15) and ext.intra_form_built(4107)
    for code in (0, 1, 2, 3, 7, 4096):
        assert not ext.intra_form_built(code)
        with pytest.raises(ValueError, match=f"tuned must be 11, 15 or 4107; got {code}"):
            # (q, k, v, g, beta, A_log, dt_bias, g type, beta type, cu_seqlens, chunk_indices, chunk_offsets, Ttot, NT,
            # H, HV, scale, lower_bound, 5 flags, qg, kg, w, u, Aqk, g_last, tuned, stream)
            ext.kda_intra(0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 100, 2, 1, 1, 1.0, -5.0, False, False, False, False,
                          False, 0, 0, 0, 0, 0, 0, code, 0)


def test_dispatch_picks_sm90_without_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    _sm90(monkeypatch)
    monkeypatch.delenv("CULA_BACKEND")  # the natural choice, not a forced one
    from cula import dispatch
    from cula.kda import kda_prefill

    kwargs = make_inputs(CASES[4], "cuda", seed=2)
    choice = dispatch.explain(validate_kda_prefill(**kwargs))
    assert choice.decisions[0].backend == "sm90" and choice.decisions[0].ok, choice.summary
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.CulaFallbackWarning)
        o, _ = kda_prefill(**kwargs)
    assert torch.isfinite(o).all()


def test_softplus_gate_is_served_and_fp16_rejected_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kimi-Linear's softplus gate (no lower bound) is served, by the "unbounded" intra form (its results: the oracle
    tests of the kimi cases); what no sm90 kernel serves is declined with the reason (here fp16 q/k/v)."""
    from cula_runtime.kda_args import gate_is_bounded

    kda = _sm90(monkeypatch)
    kwargs = make_inputs(CASES[4], "cuda", seed=3)
    kwargs["lower_bound"] = None
    kwargs["safe_gate"] = False
    args = validate_kda_prefill(**kwargs)
    assert args.use_gate_in_kernel and not gate_is_bounded(args)
    ok, reason = kda.verify_kda_prefill(args)
    assert ok, reason
    half = {**kwargs, **{name: kwargs[name].half() for name in ("q", "k", "v")}}
    ok, reason = kda.verify_kda_prefill(validate_kda_prefill(**half))
    assert not ok and "bf16" in reason


@pytest.mark.parametrize("name", ["B2-T200-H2-HV4", "varlen-0-100-100-228", "B1-T300-H2-gate-precomputed"])
def test_intra_workspace_matches_reference_intermediates(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernel 1 alone: qg, kg, w, u, Aqk and the chunk-end gate against kda_chunked's fp32 intermediates."""
    from cula_runtime.reference.kda_chunked import kda_chunked

    kda = _sm90(monkeypatch)
    case = next(c for c in CASES if c.name == name)
    kwargs = make_inputs(case, "cuda", seed=4)
    args = validate_kda_prefill(**kwargs)
    _, _, ws = _run(kda, args)
    ref_kwargs = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.reference_kwargs().items()}
    _, _, inter = kda_chunked(**ref_kwargs, return_intermediates=True)
    total = args.B * args.T
    for field in ("qg", "kg", "w", "u", "Aqk"):
        got = ws[field].float().cpu().reshape(total, args.HV, -1)
        ref = getattr(inter, field).reshape(total, args.HV, -1)
        assert torch.isfinite(got).all(), field
        assert rel_l2(got, ref) < 2e-2, f"{field}: {rel_l2(got, ref):.3e}"
    # g_last: the cumulative gate at each chunk's last valid token
    cu = args.cu_seqlens.tolist() if args.cu_seqlens is not None else [b * args.T for b in range(args.B + 1)]
    g_cum = inter.g_cum.reshape(total, args.HV, -1)
    last_rows = [min(start + c + 64, end) - 1 for start, end in itertools.pairwise(cu)
                 for c in range(0, end - start, 64)]
    assert rel_l2(ws["g_last"].cpu(), g_cum[last_rows]) < 1e-5
