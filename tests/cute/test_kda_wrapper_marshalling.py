"""The CuTeDSL host wrappers hand every kernel exactly the tensors its configuration declares, on the CPU.

The kernels cannot run here, so ``compile_cache.compile_kernel`` is replaced by a recorder and the wrappers' CUDA
device checks by no-ops; ``compile_cache.launch`` itself runs, so a wrapper that leaves out a declared tensor fails
with its ``TypeError``. Covered: ``chunk_kda_fwd_intra_from_raw`` and the recurrence on its per-chunk decay rows,
fixed and varlen, and the cutedsl backend driving both.
"""

from __future__ import annotations

import pytest
import torch

from cula_runtime import cute as cula_cute
from tests.cute.compile_helpers import launch_flow
from tests.helpers import AllocationCounter

pytestmark = pytest.mark.skipif(
    not cula_cute.is_available(),
    reason="CuTeDSL or TVM-FFI is not installed (cula-runtime brings them on Linux x86_64/aarch64)",
)

K = 128


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every launch as ``(kernel class, config, arguments)``; nothing compiles or runs."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda import intra, recurrence

    calls: list = []

    def compile_kernel(kernel_cls, config, *, target=None):
        return lambda *args: calls.append((kernel_cls, config, args))

    monkeypatch.setattr(compile_cache, "compile_kernel", compile_kernel)
    monkeypatch.setattr(compile_cache, "launch_target", lambda index: "sm_90a")
    monkeypatch.setattr(compile_cache, "_launchable", {})  # launch's table of compiled callables: this test's own
    for module in (intra, recurrence):  # the CUDA-device part of the token-tensor check
        monkeypatch.setattr(module, "check_token_tensors", lambda named, B, T: None)
    return calls


def _raw(B: int, T: int, H: int, HV: int, g_dtype=torch.float32, beta_dtype=torch.bfloat16) -> dict:
    gen = torch.Generator().manual_seed(3)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    return dict(q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, HV, K), g=randn(B, T, HV, K, dtype=g_dtype),
                beta=randn(B, T, HV, dtype=beta_dtype))


def _declared(kernel_cls, config) -> tuple:
    return kernel_cls(config).argument_specs()


@pytest.mark.parametrize("cu", [None, [0, 1, 64, 65, 130]], ids=["fixed", "varlen"])
def test_from_raw_passes_what_the_kernel_declares(cu, launches: list) -> None:
    from cula_runtime.cute.kda.intra import KdaIntra, chunk_kda_fwd_intra_from_raw

    B, T, H, HV = (2, 100, 2, 4) if cu is None else (1, 130, 2, 4)
    raw = _raw(B, T, H, HV)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    A_log, dt_bias = torch.randn(HV), torch.randn(HV * K)
    w, u, qg, kg, Aqk, g_last = chunk_kda_fwd_intra_from_raw(
        **raw, scale=0.3, A_log=A_log, dt_bias=dt_bias, lower_bound=-4.0, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu_t,
    )
    (kernel_cls, config, args), = launches
    assert kernel_cls is KdaIntra and config.l2norm
    assert (config.gate.form, config.gate.g_dtype, config.gate.beta_dtype) == ("safe", "float32", "bfloat16")
    specs = _declared(kernel_cls, config)
    tensors, scalars = args[:len(specs)], args[len(specs):]
    assert [t is None for t in tensors] == [s is None for s in specs]
    assert scalars == (0.3, -4.0)
    chunks = -(-T // 64) if cu is None else 5  # varlen lengths 1, 63, 1, 65: 1 + 1 + 1 + 2 chunks
    assert g_last.shape == (B, chunks, HV, K) and g_last.dtype == torch.float32
    assert tensors[14] is g_last and tensors[3] is raw["g"]  # g_last out, the raw g in
    assert tensors[12].shape == (HV,) and tensors[13].shape == (HV, K)  # A_log, dt_bias as the kernel indexes them
    for out in (w, u, qg, kg):
        assert out.shape == (B, T, HV, K) and out.dtype == torch.bfloat16


def test_from_raw_precomputed_gate_passes_no_gate_parameters(launches: list) -> None:
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra_from_raw

    raw = _raw(1, 70, 2, 2, g_dtype=torch.bfloat16, beta_dtype=torch.float32)
    chunk_kda_fwd_intra_from_raw(**raw, scale=0.1, A_log=torch.randn(2), lower_bound=-5.0)  # gate not in kernel
    (_, config, args), = launches
    assert config.gate.form == "none" and not config.gate.has_A_log and not config.gate.has_dt_bias
    assert args[12] is None and args[13] is None and args[-1] == 0.0  # no A_log, dt_bias, lower bound


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("given_order", [False, True], ids=["order-built", "order-given"])
def test_recurrence_on_decay_rows(varlen: bool, given_order: bool, launches: list) -> None:
    """The recurrence gets the decay rows, the chunk offsets and (varlen) the launch order: the caller's, or the
    longest-first one built from cu_seqlens."""
    from cula_runtime.cute.kda.recurrence import KdaRecurrence, chunk_kda_fwd_recurrence

    HV = 4
    B, T = (2, 100) if not varlen else (1, 130)
    cu = torch.tensor([0, 1, 64, 65, 130], dtype=torch.int32) if varlen else None
    offsets = torch.tensor([0, 1, 2, 3, 5], dtype=torch.int32) if varlen else None
    chunks = 5 if varlen else 2
    bf = [torch.zeros(B, T, HV, K, dtype=torch.bfloat16) for _ in range(4)]
    Aqk = torch.zeros(B, T, HV, 64, dtype=torch.bfloat16)
    g_last = torch.zeros(B, chunks, HV, K)
    order = torch.tensor([2, 1, 0, 3], dtype=torch.int32) if varlen and given_order else None
    o, ht = chunk_kda_fwd_recurrence(*bf, Aqk, g_last, 0.5, output_final_state=True, cu_seqlens=cu,
                                     chunk_offsets=offsets, block_v=64, seq_order=order)
    (kernel_cls, config, args), = launches
    assert kernel_cls is KdaRecurrence and config.varlen == varlen
    specs = _declared(kernel_cls, config)
    assert [t is None for t in args[:len(specs)]] == [s is None for s in specs]
    assert args[5] is g_last and (args[10] is offsets if varlen else args[10] is None)
    if varlen:  # lengths 1, 63, 1, 65: longest first unless given
        assert args[11] is order if given_order else args[11].tolist() == [3, 1, 0, 2]
    else:
        assert args[11] is None
    assert o.shape == (B, T, HV, K) and ht.shape == ((4 if varlen else B), HV, K, K)


def test_recurrence_on_decay_rows_refuses_bad_rows(launches: list) -> None:
    from cula_runtime.cute.kda.recurrence import chunk_kda_fwd_recurrence

    bf = [torch.zeros(1, 130, 2, K, dtype=torch.bfloat16) for _ in range(4)]
    Aqk = torch.zeros(1, 130, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 130], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs chunk_offsets"):
        chunk_kda_fwd_recurrence(*bf, Aqk, torch.zeros(1, 4, 2, K), 0.5, cu_seqlens=cu)
    with pytest.raises(ValueError, match="seq_order must be int32"):
        chunk_kda_fwd_recurrence(*bf, Aqk, torch.zeros(1, 2, 2, K), 0.5, cu_seqlens=cu,
                                 chunk_offsets=torch.tensor([0, 1, 4], dtype=torch.int32),
                                 seq_order=torch.tensor([1, 0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_order orders the sequences of a packed batch"):
        chunk_kda_fwd_recurrence(*bf, Aqk, torch.zeros(1, 3, 2, K), 0.5, seq_order=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"g_last must be float32 \[1, 3, 2, 128\]"):
        chunk_kda_fwd_recurrence(*bf, Aqk, torch.zeros(1, 4, 2, K), 0.5)  # 130 tokens: 3 rows
    assert not launches


@pytest.mark.parametrize("cu", [None, [0, 1, 64, 65, 130]], ids=["fixed", "varlen"])
def test_cutedsl_backend_chains_the_two_launches(cu, launches: list) -> None:
    """The backend launches the intra kernel on the raw inputs, then the recurrence on its outputs: its g_last is the
    recurrence's gate argument, read per chunk, and varlen sequences launch longest first."""
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl
    from cula_runtime.cute.kda.intra import KdaIntra
    from cula_runtime.cute.kda.recurrence import KdaRecurrence
    from cula_runtime.kda_args import validate_kda_prefill

    B, T, H, HV = (2, 100, 2, 4) if cu is None else (1, 130, 2, 4)
    raw = _raw(B, T, H, HV)
    N = B if cu is None else len(cu) - 1
    args = validate_kda_prefill(
        **raw, initial_state=torch.zeros(N, HV, K, K), output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
        A_log=torch.randn(HV), dt_bias=torch.randn(HV * K),
        cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32),
    )
    kda_prefill_cutedsl(args, block_v=64)
    (intra_cls, intra_config, intra_args), (rec_cls, rec_config, rec_args) = launches
    assert intra_cls is KdaIntra and rec_cls is KdaRecurrence
    assert intra_config.gate.form == "safe" and rec_config.has_initial_state and rec_config.varlen == (cu is not None)
    assert intra_args[0] is args.q and intra_args[3] is args.g and intra_args[4] is args.beta
    assert rec_args[5] is intra_args[14]  # g_last
    if cu is not None:  # the sequences' launch order: longest first (lengths 1, 63, 1, 65)
        assert rec_args[11].tolist() == [3, 1, 0, 2]
    assert rec_args[0] is intra_args[7] and rec_args[1] is intra_args[8]  # qg, kg
    assert rec_args[2] is intra_args[5] and rec_args[3] is intra_args[6] and rec_args[4] is intra_args[9]  # w, u, Aqk


# ---- the cutedsl backend's host path: the same launches as the public wrappers' chain, fewer allocations and
# environment reads


def _wrappers_chain(args, block_v: int):
    """What the cutedsl backend does, through the public wrappers: chunk_kda_fwd_intra_from_raw ->
    chunk_kda_fwd_recurrence, each checking its arguments and allocating its outputs."""
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra_from_raw
    from cula_runtime.cute.kda.recurrence import chunk_kda_fwd_recurrence
    from cula_runtime.index import prepare_chunk_indices, prepare_chunk_offsets, prepare_sequence_order

    cu = args.cu_seqlens
    h0 = args.initial_state
    if h0 is not None and h0.dtype != torch.float32:
        h0 = h0.float()
    lower_bound = args.lower_bound if args.use_gate_in_kernel else None
    w, u, qg, kg, Aqk, g_last = chunk_kda_fwd_intra_from_raw(
        args.q, args.k, args.v, args.g, args.beta, args.scale, A_log=args.A_log, dt_bias=args.dt_bias,
        lower_bound=lower_bound, use_qk_l2norm_in_kernel=args.use_qk_l2norm_in_kernel,
        use_gate_in_kernel=args.use_gate_in_kernel, use_beta_sigmoid_in_kernel=args.use_beta_sigmoid_in_kernel,
        allow_neg_eigval=args.allow_neg_eigval, safe_gate=args.safe_gate, cu_seqlens=cu,
        chunk_indices=None if cu is None else prepare_chunk_indices(cu, 64),
    )
    return chunk_kda_fwd_recurrence(
        qg, kg, w, u, Aqk, g_last, args.scale, initial_state=h0, output_final_state=args.output_final_state,
        cu_seqlens=cu, chunk_offsets=None if cu is None else prepare_chunk_offsets(cu, 64),
        state_v_first=args.state_v_first, block_v=block_v,
        seq_order=None if cu is None else prepare_sequence_order(cu),
    )


def _prefill_args(cu, *, l2norm=True, gate_in_kernel=True, h0_dtype=torch.float32, final_state=True,
                  v_first=False, g_dtype=torch.float32, beta_dtype=torch.bfloat16, HV=4, allow_neg_eigval=False,
                  lower_bound=-5.0, safe_gate=True):
    from cula_runtime.kda_args import validate_kda_prefill

    B, T, H = (2, 100, 2) if cu is None else (1, 130, 2)
    raw = _raw(B, T, H, HV, g_dtype=g_dtype, beta_dtype=beta_dtype)
    if not gate_in_kernel:
        raw["g"] = -torch.rand(B, T, HV, K).to(g_dtype)
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(5)
    gate = dict(use_gate_in_kernel=True, lower_bound=lower_bound, A_log=torch.randn(HV, generator=gen),
                dt_bias=torch.randn(HV * K, generator=gen)) if gate_in_kernel else {}
    return validate_kda_prefill(
        **raw, initial_state=None if h0_dtype is None else torch.randn(N, HV, K, K, generator=gen).to(h0_dtype),
        output_final_state=final_state, use_qk_l2norm_in_kernel=l2norm, use_beta_sigmoid_in_kernel=True,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, state_v_first=v_first,
        cu_seqlens=None if cu is None else torch.tensor(cu, dtype=torch.int32),
        **gate,
    )


CASES = {
    "all-in-kernel": {},
    "no-l2norm": dict(l2norm=False),
    "log-gate-no-h0-no-state": dict(gate_in_kernel=False, h0_dtype=None, final_state=False),
    "bf16-h0-v-first-bf16-g-f32-beta": dict(h0_dtype=torch.bfloat16, v_first=True, g_dtype=torch.bfloat16,
                                             beta_dtype=torch.float32),
    "neg-eigval-HV2": dict(allow_neg_eigval=True, HV=2),  # beta [B, T, 2] fp32: not a multiple of 128 bytes
    # unbounded gates: the intra kernel's unbounded form
    "unbounded-softplus": dict(lower_bound=None, safe_gate=False),
    "unbounded-lower-bound-12": dict(lower_bound=-12.0, safe_gate=False),
    "unbounded-log-gate": dict(gate_in_kernel=False, safe_gate=False, h0_dtype=None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cu", [None, [0, 1, 64, 65, 130]], ids=["fixed", "varlen"])
def test_cutedsl_backend_launches_what_the_wrappers_launch(cu, case: str, launches: list) -> None:
    """The backend calls the wrappers' internal functions and carves its intermediates from one buffer; each
    kernel still gets the configuration, the scalars and the tensors (the user's own, or the same intermediates
    flowing from launch to launch, of the same shape, dtype and strides) that the public wrappers' chain gave it."""
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl

    args = _prefill_args(cu, **CASES[case])
    o, ht = kda_prefill_cutedsl(args, block_v=64)
    new = launch_flow(list(launches), args)
    launches.clear()
    o_ref, ht_ref = _wrappers_chain(args, 64)
    old = launch_flow(list(launches), args)
    assert len(new) == len(old) == 2
    assert [launch[0].__name__ for launch in new] == ["KdaIntra", "KdaRecurrence"]
    assert new[0][1].unbounded == case.startswith("unbounded")  # the intra form follows gate_is_bounded
    for got, want in zip(new, old, strict=True):
        assert got[:3] == want[:3]  # kernel, config, scalars
        assert got[3] == want[3]  # where every tensor argument comes from
    assert o.shape == o_ref.shape and o.dtype == o_ref.dtype
    assert (ht is None) == (ht_ref is None) and (ht is None or (ht.shape, ht.dtype) == (ht_ref.shape, ht_ref.dtype))


def test_cutedsl_backend_returns_its_own_tensors(launches: list) -> None:
    """o and the final state are allocations of their own, never views of the intermediates' workspace (which
    the next call would overwrite); the intermediates are views of one buffer, each 128-byte aligned."""
    from cula_runtime.cute.kda.backend import WORKSPACE_ALIGN, kda_prefill_cutedsl

    args = _prefill_args([0, 1, 64, 65, 130])
    o, ht = kda_prefill_cutedsl(args, block_v=64)
    o2, ht2 = kda_prefill_cutedsl(args, block_v=64)
    storages = {t.untyped_storage().data_ptr() for t in (o, ht, o2, ht2)}
    assert len(storages) == 4
    intra_args = launches[-2][2]
    intermediates = [t for t in intra_args[5:10] + intra_args[14:15] if t is not None]
    assert len(intermediates) == 6  # w, u, qg, kg, Aqk, g_last
    workspace = {t.untyped_storage().data_ptr() for t in intermediates}
    assert len(workspace) == 1 and not workspace & storages
    base = intermediates[0].untyped_storage().data_ptr()
    assert all((t.data_ptr() - base) % WORKSPACE_ALIGN == 0 and t.is_contiguous() for t in intermediates)


@pytest.mark.parametrize("final_state", [True, False])
def test_cutedsl_backend_allocates_three_tensors(final_state: bool, launches: list) -> None:
    """One workspace buffer for every intermediate, o, and the final state: 3 allocations per call (2 without the
    final state), where the wrappers' chain made 8."""
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl

    args = _prefill_args(None, final_state=final_state)
    kda_prefill_cutedsl(args, block_v=64)
    with AllocationCounter() as counted:
        kda_prefill_cutedsl(args, block_v=64)
    assert counted.count == (3 if final_state else 2)


def test_cutedsl_backend_reads_each_knob_once_per_call(launches: list, monkeypatch) -> None:
    """CUTE_DSL_ARCH is read once per launch. Nothing else is read: the retired CULA_BLOCK_V, set (32 included),
    leaves the recurrence's block the per-call choice. A block_v argument other than 0, 64 or 128 (32 included) is
    a ValueError naming the accepted values, raised before any launch."""
    import os

    from cula_runtime.cute.kda import backend

    reads: list[str] = []

    class Environ(dict):
        def get(self, key, default=None):
            reads.append(key)
            return super().get(key, default)

    monkeypatch.setattr(os, "environ", Environ(os.environ))
    monkeypatch.setattr(backend, "sm_count", lambda device: 132)
    args = _prefill_args(None)
    for block_v in ("128", "32", ""):
        os.environ["CULA_BLOCK_V"] = block_v
        reads.clear()
        launches.clear()
        backend.kda_prefill_cutedsl(args)
        assert sorted(reads) == sorted(["CUTE_DSL_ARCH"] * 2)
        assert launches[-1][1].block_v == 64  # N·HV = 8 pairs fit one wave at 64
    launches.clear()
    for bad in (32, 16, 48):
        with pytest.raises(ValueError, match=rf"block_v must be 0 \(the per-call choice\), 64 or 128, got {bad}"):
            backend.kda_prefill_cutedsl(args, block_v=bad)
    assert launches == []
