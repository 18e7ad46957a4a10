"""The per-call host path of ``kda_prefill`` after its cost cuts: the validator's result object and check order, the
positional forwarding of the arguments, dispatch's cached pieces, and the sm90 shim's marshalling (one workspace
buffer, the fp32 parameters, the stream and device) driven on CPU tensors through a fake extension that reads and
writes through the raw pointers it is given (those need the ``cula_sm90`` shim importable, e.g. with
``packages/cula-sm90/src`` on ``PYTHONPATH``; the extension itself is never loaded). The tests marked ``gpu`` check
the stream query on the H200.
"""

from __future__ import annotations

import ctypes
import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch

from cula import dispatch
from cula.kda import kda_prefill
from cula_runtime.kda_args import KdaPrefillArgs, validate_kda_prefill
from cula_runtime.kda_tuning import recurrence_block_v
from tests.api.fake_sm90 import shim
from tests.gpu_backends import use_backend
from tests.kda_cases import CASES, UNBOUNDED_CASES, KdaCase, make_inputs

B, T, H, HV, K, V = 2, 70, 2, 4, 32, 16


def small(**overrides) -> dict:
    gen = torch.Generator().manual_seed(3)
    kwargs = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
                  v=torch.randn(B, T, HV, V, generator=gen), g=-torch.rand(B, T, HV, K, generator=gen),
                  beta=torch.rand(B, T, HV, generator=gen))
    kwargs.update(overrides)
    return kwargs


# ---- the validator


def test_kda_prefill_forwards_its_arguments_in_the_validators_order() -> None:
    """kda_prefill passes its arguments to validate_kda_prefill by position: both signatures must agree."""
    ours = inspect.signature(kda_prefill).parameters
    theirs = inspect.signature(validate_kda_prefill).parameters
    assert [(p.name, p.default) for p in ours.values()] == [(p.name, p.default) for p in theirs.values()]


@pytest.mark.parametrize("overrides", [
    {},
    dict(initial_state=torch.zeros(B, HV, V, K), state_v_first=True, output_final_state=True, scale=0.25),
    dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV, K), safe_gate=True, lower_bound=-2),
], ids=["plain", "state", "gate"])
def test_validated_args_are_frozen_and_complete(overrides: dict) -> None:
    args = validate_kda_prefill(**small(**overrides))
    assert type(args) is KdaPrefillArgs
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.B = 3  # type: ignore[misc]
    assert dataclasses.replace(args, output_final_state=not args.output_final_state) != args
    assert (args.B, args.T, args.H, args.HV, args.K, args.V, args.N) == (B, T, H, HV, K, V, B)
    assert isinstance(args.scale, float) and (args.lower_bound is None or isinstance(args.lower_bound, float))


def test_dt_bias_comes_out_flat_and_a_flat_one_is_kept() -> None:
    square = torch.randn(HV, K)
    args = validate_kda_prefill(**small(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=square))
    assert args.dt_bias.shape == (HV * K,) and torch.equal(args.dt_bias, square.reshape(-1))
    flat = torch.randn(HV * K)
    args = validate_kda_prefill(**small(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=flat))
    assert args.dt_bias is flat
    strided = torch.randn(HV * K * 2)[::2]
    args = validate_kda_prefill(**small(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=strided))
    assert args.dt_bias.is_contiguous() and torch.equal(args.dt_bias, strided)


FIRST_ERROR = {
    # several things wrong at once: the first in the validator's order is the one reported
    "two-flags": (dict(output_final_state=1, safe_gate="x"), TypeError, "output_final_state must be a bool, got int"),
    "k-device-before-optional-type": (dict(k=torch.randn(B, T, H, K, device="meta"), initial_state=[0.0]),
                                      ValueError, "k must be on q's device (cpu), got meta"),
    "optional-type": (dict(initial_state=[0.0]), TypeError, "initial_state must be a torch.Tensor, got list"),
    "cu-type": (dict(cu_seqlens=[0, T]), TypeError, "cu_seqlens must be a torch.Tensor, got list"),
    "A_log-dtype": (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV, dtype=torch.int32)), TypeError,
                    "A_log must have dtype in (torch.float32, torch.float64, torch.bfloat16), got torch.int32"),
    "dt_bias-dtype": (dict(use_gate_in_kernel=True, A_log=torch.zeros(HV), dt_bias=torch.zeros(HV, K).int()),
                      TypeError, "dt_bias must have dtype in (torch.float32, torch.float64, torch.bfloat16)"),
    "g-shape-before-dtype": (dict(g=torch.ones(B, T, H, K, dtype=torch.int64)), ValueError,
                             f"g must have shape [{B}, {T}, {HV}, {K}] ([B, T, HV, K]), got [{B}, {T}, {H}, {K}]"),
    "K-before-g": (dict(q=torch.randn(B, T, H, 300), k=torch.randn(B, T, H, 300)), ValueError,
                   "head dim K (q.shape[-1]) must be in [1, 256], got 300"),
    "V-range": (dict(v=torch.randn(B, T, HV, 0)), ValueError, "head dim V (v.shape[-1]) must be in [1, 256], got 0"),
    "h0-shape-before-dtype": (dict(initial_state=torch.zeros(B, HV, V, K, dtype=torch.int8)), ValueError,
                              f"initial_state must have shape [{B}, {HV}, {K}, {V}] ([N, HV, K, V], "
                              "state_v_first=False)"),
    "h0-dtype": (dict(initial_state=torch.zeros(B, HV, K, V, dtype=torch.int8)), TypeError,
                 "initial_state must have dtype in (torch.float32, torch.bfloat16, torch.float64), got torch.int8"),
}


@pytest.mark.parametrize("case", list(FIRST_ERROR), ids=list(FIRST_ERROR))
def test_the_first_failing_check_is_reported(case: str) -> None:
    overrides, exc, message = FIRST_ERROR[case]
    with pytest.raises(exc) as info:
        validate_kda_prefill(**small(**overrides))
    assert message in str(info.value), str(info.value)


# ---- dispatch


def test_accepting_backend_gives_the_same_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (10, 0))
    runner = object()
    monkeypatch.setitem(dispatch._BACKENDS, "cutedsl", lambda args: (dispatch.Decision("cutedsl", True, "ok"), runner))
    call = SimpleNamespace(device=torch.device("cuda", 0))
    for _ in range(2):  # the second summary comes from the cache
        choice = dispatch.explain(call)
        assert choice.summary == "sm_100: cutedsl is the first backend in ('cutedsl',) to accept this call"
        assert choice.runner is runner and not choice.gpu_fallback
    assert dispatch.select_backend(call) is runner


# ---- the sm90 shim, on CPU tensors through a fake extension


SHIM_CASES = {label: next(c for c in CASES if c.name == name) for label, name in (
    ("fixed-GVA", "B2-T200-H2-HV4"), ("fixed-noh0", "B3-T130-H2-noh0"),
    ("fixed-gate-precomputed", "B1-T300-H2-gate-precomputed"), ("fixed-betabf16-GVA4", "B1-T1000-H1-HV4-betabf16"),
    ("varlen-vfirst", "varlen-6seqs-GVA2-vk"), ("varlen-h0bf16-empty-seq", "varlen-3seqs-h0bf16-GVA4"),
)}


@pytest.mark.parametrize("name", list(SHIM_CASES), ids=list(SHIM_CASES))
@pytest.mark.parametrize("entry", ["run_kernels", "kda_prefill"])
def test_sm90_shim_passes_every_pointer_and_scalar(name: str, entry: str, fake_sm90) -> None:
    kda, fake = fake_sm90
    case = SHIM_CASES[name]
    kwargs = make_inputs(case, "cpu", seed=6)
    if "A_log" in kwargs:
        kwargs["A_log"] = kwargs["A_log"].bfloat16()  # the shim must hand the kernel fp32
    args = validate_kda_prefill(**kwargs)
    total, N = args.B * args.T, args.N
    fake.o_bytes = total * args.HV * 128 * 2
    fake.state_bytes = N * args.HV * 128 * 128 * 4
    cu = list(case.cu) if case.cu is not None else [b * args.T for b in range(args.B + 1)]
    rows = [[n, c] for n in range(N) for c in range(-(-(cu[n + 1] - cu[n]) // 64))]
    offsets = [0]
    for n in range(N):
        offsets.append(offsets[-1] + -(-(cu[n + 1] - cu[n]) // 64))
    num_chunks = len(rows)
    fake.reads = {5: (ctypes.c_float, args.HV), 6: (ctypes.c_float, args.HV * 128), 9: (ctypes.c_int32, N + 1),
                  10: (ctypes.c_int32, 2 * num_chunks), 11: (ctypes.c_int32, N + 1)}
    if entry == "run_kernels":
        o, ht, ws = kda.run_kernels(args, block_v=64)
    else:
        (o, ht), ws = kda.kda_prefill(args), None

    a = fake.intra
    assert len(a) == 31
    assert a[:5] == tuple(x.data_ptr() for x in (args.q, args.k, args.v, args.g, args.beta))
    if args.A_log is not None:  # converted to fp32 for the kernel (read during the launch: a temporary)
        assert fake.read[5] == args.A_log.float().tolist() and fake.read[6] == args.dt_bias.float().tolist()
    else:
        assert a[5:7] == (0, 0)
    codes = {torch.float32: 0, torch.bfloat16: 1}
    assert a[7:9] == (codes[args.g.dtype], codes[args.beta.dtype])
    assert fake.read[9] == cu
    assert fake.read[10] == [x for row in rows for x in row]
    assert fake.read[11] == offsets
    assert a[12:16] == (total, num_chunks, args.H, args.HV)
    assert a[16] == pytest.approx(args.scale) and a[17] == args.lower_bound
    assert a[18:23] == (args.use_qk_l2norm_in_kernel, args.use_gate_in_kernel, args.use_beta_sigmoid_in_kernel,
                        args.allow_neg_eigval, args.use_gate_in_kernel and args.lower_bound is None)
    # the form with the tensor-core inverse, computing only the bands holding tokens when the partial last chunks leave
    # enough bands idle (the default: "auto"), the stream
    idle = sum((64 - (b - a) % 64) // 16 for a, b in zip(cu[:-1], cu[1:], strict=True) if (b - a) % 64)
    assert a[29:31] == (15 if 5 * idle >= num_chunks else 11, 777)
    workspace = a[23:29]
    assert all(ptr % 256 == workspace[0] % 256 and ptr % 16 == 0 for ptr in workspace)

    r = fake.recurrence
    assert len(r) == 26 and r[21:] == (0, 0, 0, 0, 0)  # (after the stream: the state-pool form's, unused here)
    assert r[:6] == workspace and r[6] == a[9] and r[7] == a[11]
    if case.cu is None:  # equal lengths: slot order
        assert r[8] == 0 and fake.order is None
    else:  # longest first, ties in batch order
        lens = [cu[n + 1] - cu[n] for n in range(N)]
        assert fake.order == sorted(range(N), key=lambda n: -lens[n])
    h0 = args.initial_state
    assert r[9:11] == ((0, 0) if h0 is None else (h0.data_ptr(), codes[h0.dtype]))
    assert r[11] == (ht.data_ptr() if ht is not None else 0) and r[12] == o.data_ptr()
    assert r[13:15] == (N, args.HV) and r[15] == pytest.approx(args.scale) and r[16] == args.state_v_first
    assert r[17] == (64 if entry == "run_kernels" else recurrence_block_v(N * args.HV, 132))
    # (a V block of 64 or 128: warpgroup MMAs) launched as a programmatic dependent of the intra kernel (no
    # CULA_SM90_PDL: "auto", and these cases' CTAs fit on 132 SMs), the token count (the workspace's and o's rows),
    # the stream
    assert r[18] is True and r[19] == total and r[20] == 777
    assert o.shape == (args.B, args.T, args.HV, 128) and o.dtype == torch.bfloat16
    assert bool((o.view(torch.uint8) == fake.O_BYTE).all())
    if ht is not None:
        assert ht.shape == args.state_shape and bool((ht.view(torch.uint8) == fake.STATE_BYTE).all())

    if ws is not None:  # the views sit exactly where the kernels wrote, one byte value per region
        expected = {"qg": (total, 128, torch.bfloat16), "kg": (total, 128, torch.bfloat16),
                    "w": (total, 128, torch.bfloat16), "u": (total, 128, torch.bfloat16),
                    "Aqk": (total, 64, torch.bfloat16), "g_last": (num_chunks, 128, torch.float32)}
        assert list(ws) == list(expected)
        for byte, (field, (rows_, width, dtype)) in enumerate(expected.items(), start=1):
            view = ws[field]
            assert view.shape == (rows_, args.HV, width) and view.dtype == dtype and view.is_contiguous()
            assert view.data_ptr() == workspace[byte - 1]
            assert bool((view.view(torch.uint8) == byte).all()), field


def test_sm90_indices_follow_an_in_place_update_of_cu_seqlens(fake_sm90) -> None:
    """The shim's cached (chunk indices, chunk offsets) are keyed on the tensor's version: new contents, new indices."""
    kda, fake = fake_sm90
    kwargs = make_inputs(next(c for c in CASES if c.name == "varlen-0-100-100-228"), "cpu", seed=7)
    cu = kwargs["cu_seqlens"]
    fake.o_bytes, fake.state_bytes = 228 * 2 * 128 * 2, 3 * 2 * 128 * 128 * 4
    for bounds, rows, offsets in (([0, 100, 100, 228], [0, 0, 0, 1, 2, 0, 2, 1], [0, 2, 2, 4]),
                                  ([0, 10, 150, 228], [0, 0, 1, 0, 1, 1, 1, 2, 2, 0, 2, 1], [0, 1, 4, 6]),
                                  ([0, 100, 100, 228], [0, 0, 0, 1, 2, 0, 2, 1], [0, 2, 2, 4])):
        cu.copy_(torch.tensor(bounds, dtype=torch.int32))
        args = validate_kda_prefill(**kwargs)
        fake.reads = {9: (ctypes.c_int32, 4), 10: (ctypes.c_int32, len(rows)), 11: (ctypes.c_int32, 4)}
        kda.kda_prefill(args)
        assert fake.read == {9: bounds, 10: rows, 11: offsets}
        assert fake.intra[13] == len(rows) // 2  # the number of chunks


def _varlen_228_args(fake) -> object:
    """Validated CPU arguments of the varlen-0-100-100-228 case (3 sequences, one empty), with the fake extension's
    o and final-state sizes set for them."""
    kwargs = make_inputs(next(c for c in CASES if c.name == "varlen-0-100-100-228"), "cpu", seed=7)
    fake.o_bytes, fake.state_bytes = 228 * 2 * 128 * 2, 3 * 2 * 128 * 128 * 4
    return validate_kda_prefill(**kwargs)


def test_sm90_shim_copies_a_tensor_that_starts_off_16_bytes(fake_sm90) -> None:
    """A contiguous q whose data starts 2 bytes into its storage (a valid input) reaches the kernel as a 16-byte
    aligned copy with the same values; aligned tensors are passed as they are."""
    kda, fake = fake_sm90
    kwargs = make_inputs(next(c for c in CASES if c.name == "varlen-0-100-100-228"), "cpu", seed=7)
    fake.o_bytes, fake.state_bytes = 228 * 2 * 128 * 2, 3 * 2 * 128 * 128 * 4
    q = kwargs["q"]
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    shifted.copy_(q)
    assert shifted.is_contiguous() and shifted.data_ptr() % 16 == 2
    kwargs["q"] = shifted
    args = validate_kda_prefill(**kwargs)
    kda.kda_prefill(args)
    assert fake.intra[0] % 16 == 0 and fake.intra[0] != shifted.data_ptr()
    assert fake.intra[1] == args.k.data_ptr()  # aligned: the tensor itself
    fake.reads = {0: (ctypes.c_uint16, q.numel())}
    kda.kda_prefill(args)
    assert fake.read[0] == [x & 0xFFFF for x in q.view(torch.int16).flatten().tolist()]  # the same bf16 values


def test_sm90_retired_knobs_are_not_read(fake_sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    """The knobs of the forms retired in issue 25 (batch-order launch, the persistent intra kernel, the mma.sync
    recurrence at V blocks of 64 and 128, the 3-stage recurrence) are read no more: set to their old non-default
    values, the launches are the defaults' (varlen sequences longest first, the "auto" intra form, warpgroup MMAs)."""
    kda, fake = fake_sm90
    args = _varlen_228_args(fake)
    kda.kda_prefill(args)
    default = (fake.intra[29:], fake.recurrence[8], fake.order, fake.recurrence[13:])
    assert fake.order == [2, 0, 1]  # 128, 100 and 0 tokens
    for variable, value in (("CULA_SM90_LONGEST_FIRST", "0"), ("CULA_SM90_INTRA_PERSISTENT", "1"),
                            ("CULA_SM90_RECURRENCE_WGMMA", "0"), ("CULA_SM90_RECURRENCE_STAGES", "3")):
        monkeypatch.setenv(variable, value)
    kda.kda_prefill(args)
    assert (fake.intra[29:], fake.recurrence[8], fake.order, fake.recurrence[13:]) == default
    for retired in (dict(intra_ctas=5), dict(intra_prefetch=2), dict(recurrence_wgmma=False),
                    dict(recurrence_stages=3)):  # run_kernels' keyword arguments for them are gone too
        with pytest.raises(TypeError, match=next(iter(retired))):
            kda.run_kernels(args, **retired)


def _refuses_bad_knob(kda, fake, args, monkeypatch: pytest.MonkeyPatch, *, argument: str, bad: tuple,
                      variable: str, bad_value: str, **given) -> None:
    """``run_kernels(**given, argument=b)`` for each b in ``bad``, and ``kda_prefill`` with ``variable=bad_value``,
    are ValueErrors naming the argument / the variable and its value, raised before any launch."""
    fake.intra = ()
    for value in bad:
        with pytest.raises(ValueError, match=argument):
            kda.run_kernels(args, **given, **{argument: value})
    monkeypatch.setenv(variable, bad_value)
    with pytest.raises(ValueError, match=f"{variable}={bad_value!r}"):
        kda.kda_prefill(args)
    assert fake.intra == ()  # refused before any launch


def test_sm90_recurrence_block_v(fake_sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    """The recurrence's V block: the heuristic's (whole warpgroups, 64 or 128: warpgroup MMAs) by default, or what
    run_kernels(block_v=...) asks for; the shim passes the block and nothing else about the form. The retired
    block 32 (mma.sync) is refused by run_kernels with a ValueError naming the accepted values, before any launch,
    and the retired CULA_BLOCK_V is not read."""
    kda, fake = fake_sm90
    args = _varlen_228_args(fake)
    kda.kda_prefill(args)
    assert fake.recurrence[17] == 64  # 6 pairs: the heuristic keeps whole warpgroups
    for block_v in (64, 128):
        kda.run_kernels(args, block_v=block_v)
        assert fake.recurrence[17] == block_v
    for value in ("32", "128"):
        monkeypatch.setenv("CULA_BLOCK_V", value)
        kda.kda_prefill(args)
        assert fake.recurrence[17] == 64
    fake.intra = fake.recurrence = ()
    for bad in (32, 16, 48, 256):
        with pytest.raises(ValueError, match=rf"block_v must be 0 \(the per-call choice\), 64 or 128, got {bad}"):
            kda.run_kernels(args, block_v=bad)
    assert fake.intra == () and fake.recurrence == ()  # refused before any launch


def test_sm90_programmatic_launch_knob(fake_sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    """CULA_SM90_PDL: "1" launches the recurrence as a programmatic dependent of the intra kernel, "0" in plain
    stream order, "auto" (the default) the first when its CTAs fit on the SMs at once; another value is a ValueError
    naming the variable and its value, before any launch."""
    kda, fake = fake_sm90
    args = _varlen_228_args(fake)  # 3 sequences x 2 value heads x 2 V blocks of 64 = 12 recurrence CTAs
    kda.kda_prefill(args)
    assert fake.recurrence[17] == 64 and fake.recurrence[18] is True  # 12 CTAs on 132 SMs: one wave
    for sms, expected in ((12, True), (11, False)):
        monkeypatch.setattr(kda, "sm_count", lambda device, sms=sms: sms)
        kda.run_kernels(args, block_v=64)
        assert fake.recurrence[18] is expected, sms
        monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "1")
        kda.run_kernels(args, block_v=64)
        assert fake.recurrence[18] is True, sms
        monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "auto")
        kda.run_kernels(args, block_v=64)
        assert fake.recurrence[18] is expected, sms
        monkeypatch.delenv(kda.ENV_PROGRAMMATIC_LAUNCH)
    monkeypatch.setattr(kda, "sm_count", lambda device: 132)
    monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "0")
    kda.kda_prefill(args)
    assert fake.recurrence[18] is False
    kda.run_kernels(args, block_v=64)
    assert fake.recurrence[18] is False
    monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "1")
    kda.run_kernels(args, block_v=64)
    assert fake.recurrence[18] is True
    fake.intra = ()
    monkeypatch.setenv(kda.ENV_PROGRAMMATIC_LAUNCH, "yes")
    with pytest.raises(ValueError, match=f"{kda.ENV_PROGRAMMATIC_LAUNCH}='yes'"):
        kda.kda_prefill(args)
    assert fake.intra == ()  # refused before any launch


def test_sm90_intra_auto_form_follows_the_idle_bands(fake_sm90) -> None:
    """"auto" (the default intra form) runs "bands" (15) when the partial last chunks leave at least one idle 16-row
    band per 5 chunks, else "tensor" (11): decided per call from the lengths (a plan's calls may differ), and once
    for a fixed-length batch."""
    kda, fake = fake_sm90
    kwargs = make_inputs(next(c for c in CASES if c.name == "varlen-0-100-100-228"), "cpu", seed=7)
    fake.o_bytes, fake.state_bytes = 228 * 2 * 128 * 2, 3 * 2 * 128 * 128 * 4
    calls = (([0, 100, 100, 228], 15), ([0, 49, 164, 228], 11), ([0, 52, 164, 228], 15), ([0, 177, 228, 228], 11))
    plan = None
    for bounds, bits in calls:
        kwargs["cu_seqlens"] = torch.tensor(bounds, dtype=torch.int32)
        args = validate_kda_prefill(**kwargs)
        kda.kda_prefill(args)
        assert fake.intra[29] == bits, bounds
        plan = plan or kda.plan_kda_prefill(args)  # the first call's plan, for every call below
    for bounds, bits in calls:
        cu = torch.tensor(bounds, dtype=torch.int32)
        plan(*(kwargs.get(name) for name in ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")), cu,
             cu.clone())
        assert fake.intra[29] == bits, ("plan", bounds)
    for T, bits in ((1000, 11), (80, 15), (128, 11)):  # idle bands per sequence: 1 of 16 chunks, 3 of 2, none
        case = KdaCase(name=f"B2-T{T}", B=2, T=T, H=2, HV=2)
        fake.o_bytes, fake.state_bytes = 2 * T * 2 * 128 * 2, 2 * 2 * 128 * 128 * 4
        kda.kda_prefill(validate_kda_prefill(**make_inputs(case, "cpu", seed=3)))
        assert fake.intra[29] == bits, T


@pytest.mark.parametrize("case", UNBOUNDED_CASES, ids=[c.name for c in UNBOUNDED_CASES])
def test_sm90_unbounded_gates_run_the_unbounded_form(case, fake_sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every call whose gate can leave [-5, 0] launches the "unbounded" intra form (4107) whatever
    CULA_SM90_INTRA_TUNED asks for (the other forms would overflow), with the in-kernel softplus flag exactly for
    the softplus form and the lower bound passed as given; a bounded call still follows the knob."""
    kda, fake = fake_sm90
    args = validate_kda_prefill(**make_inputs(case, "cpu", seed=2))
    fake.o_bytes = args.B * args.T * args.HV * 128 * 2
    fake.state_bytes = args.N * args.HV * 128 * 128 * 4
    for knob in ("auto", "tensor", "bands"):
        monkeypatch.setenv(kda.ENV_INTRA_TUNED, knob)
        kda.kda_prefill(args)
        assert fake.intra[29] == kda._TUNED_FORMS["unbounded"] == 4107, knob
        assert fake.intra[22] is (case.gate_in_kernel and case.gate != "wide")  # softplus in kernel
        if case.gate == "wide":
            assert fake.intra[17] == -12.0
    bounded = validate_kda_prefill(**make_inputs(CASES[4], "cpu", seed=2))
    fake.o_bytes = bounded.B * bounded.T * bounded.HV * 128 * 2
    fake.state_bytes = bounded.N * bounded.HV * 128 * 128 * 4
    for knob, bits in (("tensor", 11), ("unbounded", 4107)):
        monkeypatch.setenv(kda.ENV_INTRA_TUNED, knob)
        kda.kda_prefill(bounded)
        assert fake.intra[29] == bits and fake.intra[22] is False, knob


def test_sm90_intra_tuned_knob(fake_sm90, monkeypatch: pytest.MonkeyPatch) -> None:
    """CULA_SM90_INTRA_TUNED=tensor|bands (or run_kernels(intra_tuned=...)) asks for the intra kernel's form as the
    bit set 11|15, "auto" (the default) for 11 or 15 by the call's idle bands, "ablate:*" for the timing-only forms;
    the retired forms "0", "norm", "inverse" and "all" and other bad values are ValueErrors naming the variable or
    argument and the accepted values, before any launch."""
    kda, fake = fake_sm90
    args = _varlen_228_args(fake)
    kda.kda_prefill(args)
    assert fake.intra[29] == 15  # lengths 100, 0, 128: 1 idle band over 4 chunks
    for value, bits in (("tensor", 11), ("bands", 15), ("auto", 15), ("ablate:products", 75), ("ablate:solve", 267)):
        monkeypatch.setenv(kda.ENV_INTRA_TUNED, value)
        kda.kda_prefill(args)
        assert fake.intra[29] == bits, value
    monkeypatch.setenv(kda.ENV_INTRA_TUNED, "bands")
    kda.run_kernels(args, intra_tuned="tensor")
    assert fake.intra[29] == 11  # the argument overrides the variable
    accepted = str(sorted(kda._TUNED_FORMS))
    fake.intra = ()
    for retired in ("0", "norm", "inverse", "all"):
        monkeypatch.setenv(kda.ENV_INTRA_TUNED, retired)
        with pytest.raises(ValueError) as info:
            kda.kda_prefill(args)
        assert str(info.value) == f"{kda.ENV_INTRA_TUNED}={retired!r}: expected one of {accepted}"
        with pytest.raises(ValueError, match="intra_tuned must be None or one of"):
            kda.run_kernels(args, intra_tuned=retired)
    assert fake.intra == ()  # refused before any launch
    assert {"tensor", "bands", "auto"} <= set(kda._TUNED_FORMS) and not {"0", "norm", "inverse", "all"} & set(
        kda._TUNED_FORMS)
    _refuses_bad_knob(kda, fake, args, monkeypatch, argument="intra_tuned", bad=(True, 11, "11", "both"),
                      variable=kda.ENV_INTRA_TUNED, bad_value="yes")


def test_empty_call_launches_nothing(fake_sm90) -> None:
    kda, fake = fake_sm90
    h0 = torch.randn(1, 2, 128, 128)
    q = torch.zeros(1, 0, 2, 128, dtype=torch.bfloat16)
    args = validate_kda_prefill(q, q, q, torch.zeros(1, 0, 2, 128), torch.zeros(1, 0, 2), initial_state=h0,
                                output_final_state=True, safe_gate=True)
    o, ht = kda.kda_prefill(args)
    assert o.shape == (1, 0, 2, 128) and torch.equal(ht, h0) and fake.intra == () and fake.recurrence == ()


@pytest.mark.parametrize("total,HV,num_chunks", [(1, 1, 1), (200, 4, 4), (777, 3, 15), (65, 64, 2), (4096, 64, 64)])
def test_workspace_regions_are_disjoint_and_aligned(total: int, HV: int, num_chunks: int) -> None:
    regions, size = shim().workspace_layout(total, HV, num_chunks)
    assert [r.name for r in regions] == ["qg", "kg", "w", "u", "Aqk", "g_last"]
    assert regions[0].offset == 0
    for region, after in zip(regions, regions[1:], strict=False):
        assert after.offset % 256 == 0 and region.offset + region.nbytes <= after.offset < region.offset + \
            region.nbytes + 256
    last = regions[-1]
    assert last.offset + last.nbytes <= size < last.offset + last.nbytes + 256
    assert regions[-1].shape == (num_chunks, HV, 128) and regions[4].shape == (total, HV, 64)


def test_sm90_verify_asks_the_cached_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    kda = shim()
    args = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(kda, "device_capability", lambda device: (10, 0))
    assert kda.verify_kda_prefill(args) == (False, "built for sm_90a only; this GPU is sm_100")


@pytest.mark.parametrize("fail", [False, True], ids=["launched", "recurrence-fails"])
def test_sm90_workspace_is_a_raw_block_returned_after_both_launches(fail: bool, fake_sm90, monkeypatch) -> None:
    """kda_prefill's workspace comes from the caching allocator's raw interface on the call's stream, the kernels get
    its address plus each region's offset, and the block goes back once both kernels are queued (also when a launch
    raises); run_kernels keeps a tensor (its views are returned)."""
    kda, fake = fake_sm90
    case = SHIM_CASES["varlen-vfirst"]
    args = validate_kda_prefill(**make_inputs(case, "cpu", seed=3))
    fake.o_bytes = args.B * args.T * args.HV * 128 * 2
    fake.state_bytes = args.N * args.HV * 128 * 128 * 4
    blocks, events, launched = {}, [], []
    intra, recurrence = fake.kda_intra, fake.kda_recurrence

    def counted_intra(*a) -> int:
        launched.append("intra")
        return intra(*a)

    def counted_recurrence(*a) -> int:
        launched.append("recurrence")
        if fail:
            raise RuntimeError("cula_sm90.kda_recurrence: CUDA error 1")
        return recurrence(*a)

    def raw_alloc(nbytes: int, stream: int) -> int:
        block = ctypes.create_string_buffer(nbytes + 256)
        base = ctypes.addressof(block) + (-ctypes.addressof(block) % 256)  # (the allocator's blocks are aligned)
        blocks[base] = block
        events.append(("alloc", nbytes, stream, len(launched)))
        return base

    def raw_delete(ptr: int) -> None:
        events.append(("delete", ptr, len(launched)))

    monkeypatch.setattr(fake, "kda_intra", counted_intra)
    monkeypatch.setattr(fake, "kda_recurrence", counted_recurrence)
    monkeypatch.setattr(kda, "_uses_raw_workspace", lambda device: True)
    monkeypatch.setattr(kda, "_raw_alloc", raw_alloc)
    monkeypatch.setattr(kda, "_raw_delete", raw_delete)
    if fail:
        with pytest.raises(RuntimeError, match="kda_recurrence"):
            kda.kda_prefill(args)
    else:
        o, ht = kda.kda_prefill(args)
        assert bool((o.view(torch.uint8) == fake.O_BYTE).all())
    (base,) = blocks
    num_chunks = fake.intra[13]
    regions, nbytes = kda.workspace_layout(args.B * args.T, args.HV, num_chunks)
    assert events == [("alloc", nbytes, 777, 0), ("delete", base, 2)]
    assert fake.intra[23:29] == tuple(base + region.offset for region in regions)
    if not fail:
        assert fake.recurrence[:6] == fake.intra[23:29]
        events.clear()
        kda.run_kernels(args)  # (its workspace views need a tensor: no raw block)
        assert events == []


def test_sm90_stream_and_device_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    kda = shim()
    monkeypatch.setattr(kda, "_raw_current_stream", None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: SimpleNamespace(cuda_stream=1000 + index))
    assert kda._current_stream(2) == 1002  # without torch's raw query: torch.cuda.current_stream
    monkeypatch.setattr(kda, "_raw_current_stream", lambda index: 2000 + index)
    assert kda._current_stream(2) == 2002
    monkeypatch.setattr(kda, "_raw_current_device", None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert kda._device_guard(0) is kda._SAME_DEVICE  # without torch's raw query: torch.cuda.current_device
    guard = kda._device_guard(1)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    monkeypatch.setattr(kda, "_raw_current_device", lambda: 1)
    assert kda._device_guard(1) is kda._SAME_DEVICE
    guard = kda._device_guard(0)
    assert isinstance(guard, torch.cuda.device) and guard.idx == 0


# ---- the sm90 shim's state-pool form (issue 26), through the fake extension

POOL_CU = [0, 70, 70, 75, 205, 206]  # packed: 5 sequences, the second empty
POOL_SLOTS = [4, 0, -1, 2, 6]  # the third a padding row
POOL_HAS = [True, False, True, False, True]
POOL_P, POOL_H, POOL_HV = 8, 2, 4


def _pool_kwargs(*, varlen: bool, dtype: torch.dtype, v_first: bool, has: bool, spread: int = 1, T: int = 67,
                 seed: int = 11) -> tuple[dict, torch.Tensor]:
    """A pool-form call's arguments (bf16 q/k/v, K = V = 128, GVA 2) and the storage its pool is a view of: slots
    ``spread`` apart (the slot stride is free), the storage between them never to be touched."""
    gen = torch.Generator().manual_seed(seed)
    B, T = (1, POOL_CU[-1]) if varlen else (len(POOL_SLOTS), T)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    storage = rand(POOL_P * spread, POOL_HV, 128, 128).to(dtype)
    kwargs = dict(q=rand(B, T, POOL_H, 128).bfloat16(), k=rand(B, T, POOL_H, 128).bfloat16(),
                  v=rand(B, T, POOL_HV, 128).bfloat16(), g=-torch.rand(B, T, POOL_HV, 128, generator=gen),
                  beta=torch.rand(B, T, POOL_HV, generator=gen), safe_gate=True, state_v_first=v_first,
                  state=storage[::spread], state_indices=torch.tensor(POOL_SLOTS, dtype=torch.int32),
                  has_initial_state=torch.tensor(POOL_HAS) if has else None)
    if varlen:
        kwargs["cu_seqlens"] = torch.tensor(POOL_CU, dtype=torch.int32)
    return kwargs, storage


def _expected_storage(fake, before: torch.Tensor, spread: int, slots: list[int], has: list[bool] | None,
                      ) -> torch.Tensor:
    """``before`` with each named slot as the fake recurrence writes it (its start state read: POOL_BYTE; from zeros
    where has_initial_state is False: 0); padding rows and the other slots bit-unchanged."""
    expected = before.clone()
    slot_views = expected[::spread]
    for n, slot in enumerate(slots):
        if slot >= 0:
            slot_views[slot].view(torch.uint8).fill_(fake.POOL_BYTE if has is None or has[n] else 0)
    return expected


POOL_FORMS = {  # name: (varlen, pool dtype, state_v_first, has_initial_state given, slot spread)
    "varlen-fp32-kv-has": (True, torch.float32, False, True, 1),
    "varlen-bf16-vk": (True, torch.bfloat16, True, False, 1),
    "fixed-fp32-vk-has-spread2": (False, torch.float32, True, True, 2),
    "fixed-bf16-kv-spread3": (False, torch.bfloat16, False, False, 3),
}


@pytest.mark.parametrize("entry", ["kda_prefill", "run_kernels", "plan"])
@pytest.mark.parametrize("form", list(POOL_FORMS), ids=list(POOL_FORMS))
def test_sm90_shim_passes_the_state_pool_in_place(form: str, entry: str, fake_sm90) -> None:
    """The recurrence gets the caller's pool itself (its address, P and slot stride: no gather or scatter copy), the
    slot indices and has_initial_state (or 0) as the validator left them, the pool's dtype code and no initial or
    final state tensor; its writes land in the caller's pool in place, and the call returns (o, None)."""
    kda, fake = fake_sm90
    varlen, dtype, v_first, has, spread = POOL_FORMS[form]
    kwargs, storage = _pool_kwargs(varlen=varlen, dtype=dtype, v_first=v_first, has=has, spread=spread)
    args = validate_kda_prefill(**kwargs)
    before = storage.clone()
    fake.o_bytes, fake.state_bytes = args.B * args.T * POOL_HV * 128 * 2, 0
    if entry == "kda_prefill":
        o, ht = kda.kda_prefill(args)
    elif entry == "run_kernels":
        o, ht, workspace = kda.run_kernels(args)
        assert list(workspace) == ["qg", "kg", "w", "u", "Aqk", "g_last"]
    else:
        plan = kda.plan_kda_prefill(args)
        o, ht = plan(args.q, args.k, args.v, args.g, args.beta, None, None, None, args.cu_seqlens,
                     args.cu_seqlens_host, state=args.state, state_indices=args.state_indices,
                     has_initial_state=args.has_initial_state)
    assert ht is None and o.shape == (args.B, args.T, POOL_HV, 128) and o.dtype == torch.bfloat16
    r = fake.recurrence
    assert len(r) == 26 and r[9] == 0 and r[11] == 0  # no initial or final state tensor
    assert r[10] == (0 if dtype == torch.float32 else 1) and r[16] is v_first
    assert r[18] is True and r[20] == 777  # (programmatic after the intra kernel: "auto", one wave)
    has_ptr = args.has_initial_state.data_ptr() if has else 0
    assert r[21:26] == (storage.data_ptr(), args.state_indices.data_ptr(), has_ptr, POOL_P,
                        spread * POOL_HV * 128 * 128)
    assert fake.pool_read == (POOL_SLOTS, POOL_HAS if has else None)
    expected = _expected_storage(fake, before, spread, POOL_SLOTS, POOL_HAS if has else None)
    assert torch.equal(storage.view(torch.uint8), expected.view(torch.uint8))
    assert fake.intra[12] == args.B * args.T  # (the intra launch as for any call)


def test_sm90_launches_refuse_a_pool_they_were_not_made_for(fake_sm90) -> None:
    """A plan made for a pool-form signature needs the pool, and one made without a pool refuses one: ValueError,
    before any launch."""
    kda, fake = fake_sm90
    kwargs, _ = _pool_kwargs(varlen=True, dtype=torch.float32, v_first=False, has=True)
    pooled = validate_kda_prefill(**kwargs)
    fake.o_bytes, fake.state_bytes = pooled.T * POOL_HV * 128 * 2, 0
    plan = kda.plan_kda_prefill(pooled)
    tensors = (pooled.q, pooled.k, pooled.v, pooled.g, pooled.beta, None, None, None, pooled.cu_seqlens,
               pooled.cu_seqlens_host)
    with pytest.raises(ValueError, match="state-pool call"):
        plan(*tensors)
    dense = kda.plan_kda_prefill(dataclasses.replace(pooled, state=None, state_indices=None, has_initial_state=None,
                                                     pool_slots=None))
    with pytest.raises(ValueError, match="without a state pool"):
        dense(*tensors, state=pooled.state, state_indices=pooled.state_indices)
    assert fake.intra == () and fake.recurrence == ()


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_sm90_pool_call_without_tokens_passes_the_start_states_to_their_slots(varlen: bool, fake_sm90) -> None:
    """B * T == 0 with N > 0 zero-length sequences: no intra launch; the recurrence alone, in stream order (nothing
    before it to depend on), on all-zero boundaries and no workspace or o, writes each start state (zeros where
    has_initial_state is False) back to its slot, as the reference does; the padding row's slot is untouched."""
    kda, fake = fake_sm90
    slots, has = [2, -1, 0], [False, True, True]
    B, N = (1, 3) if varlen else (3, 3)
    pool = torch.randn(4, POOL_HV, 128, 128)
    before = pool.clone()
    q = torch.zeros(B, 0, POOL_H, 128, dtype=torch.bfloat16)
    v = torch.zeros(B, 0, POOL_HV, 128, dtype=torch.bfloat16)
    args = validate_kda_prefill(q, q, v, torch.zeros(B, 0, POOL_HV, 128), torch.zeros(B, 0, POOL_HV), safe_gate=True,
                                cu_seqlens=torch.zeros(N + 1, dtype=torch.int32) if varlen else None, state=pool,
                                state_indices=torch.tensor(slots, dtype=torch.int32),
                                has_initial_state=torch.tensor(has))
    fake.o_bytes = fake.state_bytes = 0
    o, ht = kda.kda_prefill(args)
    assert o.shape == (B, 0, POOL_HV, 128) and ht is None and fake.intra == ()
    r = fake.recurrence
    assert len(r) == 26 and r[:6] == (0,) * 6 and r[6] == r[7] and fake.bounds == [0] * (N + 1)
    assert r[8:10] == (0, 0) and r[11:15] == (0, 0, N, POOL_HV) and r[18:21] == (False, 0, 777)
    assert r[21:26] == (pool.data_ptr(), args.state_indices.data_ptr(), args.has_initial_state.data_ptr(), 4,
                        POOL_HV * 128 * 128)
    assert torch.equal(pool.view(torch.uint8), _expected_storage(fake, before, 1, slots, has).view(torch.uint8))


# ---- on the GPU


@pytest.mark.gpu
def test_sm90_stream_query_names_the_current_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend("sm90", monkeypatch)
    from cula_sm90 import kda

    index = torch.cuda.current_device()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert kda._current_stream(index) == side.cuda_stream == torch.cuda.current_stream(index).cuda_stream
    assert kda._current_stream(index) == torch.cuda.current_stream(index).cuda_stream
    assert kda._device_guard(index) is kda._SAME_DEVICE


@pytest.mark.gpu
def test_sm90_on_a_side_stream_gives_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend("sm90", monkeypatch)
    kwargs = make_inputs(next(c for c in CASES if c.name == "varlen-0-1-64-65-200"), "cuda", seed=9)
    o_ref, ht_ref = kda_prefill(**kwargs)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the side stream is busy when the kernels are queued behind it
        o, ht = kda_prefill(**kwargs)
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


@pytest.mark.gpu
def test_sm90_workspace_blocks_follow_stream_order_and_go_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw workspace block of a call goes back to the caching allocator once both kernels are queued: calls on
    two streams (one held busy) and back-to-back calls of one shape on one stream give each call's own bits, and
    repeated calls leave no memory allocated."""
    use_backend("sm90", monkeypatch)
    assert shim()._uses_raw_workspace(torch.device("cuda"))  # (this torch has the raw interface: the path is run)
    case = next(c for c in CASES if c.name == "varlen-0-1-64-65-200")
    kw_a, kw_b = make_inputs(case, "cuda", seed=21), make_inputs(case, "cuda", seed=22)
    ref_a, ref_b = kda_prefill(**kw_a), kda_prefill(**kw_b)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the side stream's call waits while the main stream's run
        out_side = [kda_prefill(**kw_a), kda_prefill(**kw_b)]
    out_main = [kda_prefill(**kw_b), kda_prefill(**kw_a), kda_prefill(**kw_b)]
    main.wait_stream(side)
    for (o, ht), (o_ref, ht_ref) in zip(out_side + out_main, [ref_a, ref_b, ref_b, ref_a, ref_b], strict=True):
        assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)
    del out_side, out_main, o, ht
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_a_pool_call_through_the_api_is_planned_and_its_plan_writes_the_pool(fake_sm90, monkeypatch) -> None:
    """``cula.kda.kda_prefill`` with a pool whose indices are GPU tensors (stood in for by CPU ones here: the host
    check of their values is what keeps CPU calls unplanned) leaves a plan; the second call of the signature runs it
    without validation and its writes land in that call's pool."""
    import cula.kda
    from cula import call_plans, dispatch

    kda, fake = fake_sm90
    validations = []

    def counted(*a):
        validations.append(1)
        return validate_kda_prefill(*a)

    monkeypatch.setattr(cula.kda, "validate_kda_prefill", counted)
    monkeypatch.setattr(cula.kda, "select_backend", lambda args: kda.kda_prefill)
    monkeypatch.setattr(dispatch, "_planners", {kda.kda_prefill: kda.plan_kda_prefill})
    monkeypatch.setattr(call_plans, "indices_checked_on_host", lambda idx: False)
    call_plans.clear_call_plans()
    try:
        for attempt in range(2):
            kwargs, storage = _pool_kwargs(varlen=True, dtype=torch.float32, v_first=False, has=True)
            args = validate_kda_prefill(**kwargs)
            fake.o_bytes, fake.state_bytes = args.B * args.T * POOL_HV * 128 * 2, 0
            before = storage.clone()
            o, ht = cula.kda.kda_prefill(**kwargs)
            assert ht is None and validations == [1], f"call {attempt}: validated {len(validations)} times"
            assert fake.recurrence[21] == storage.data_ptr()
            expected = _expected_storage(fake, before, 1, POOL_SLOTS, POOL_HAS)
            assert torch.equal(storage.view(torch.uint8), expected.view(torch.uint8))
    finally:
        call_plans.clear_call_plans()
