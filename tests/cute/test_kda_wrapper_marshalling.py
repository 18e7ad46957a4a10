"""The CuTeDSL host wrappers hand every kernel exactly the tensors its configuration declares, on the CPU.

The kernels cannot run here, so ``compile_cache.compile_kernel`` is replaced by a recorder and the wrappers' CUDA
device checks by no-ops; ``compile_cache.launch`` itself runs, so a wrapper that leaves out a declared tensor fails
with its ``TypeError``. Covered: the fused-prepare path (``chunk_kda_fwd_intra_from_raw`` and the recurrence on its
per-chunk decay rows), fixed and varlen, and the cutedsl backend driving both.
"""

from __future__ import annotations

import pytest
import torch

from cula_runtime import cute as cula_cute

pytestmark = pytest.mark.skipif(
    not cula_cute.is_available(), reason='CuTeDSL or TVM-FFI is not installed (pip install "cula-runtime[cute]")'
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
    assert kernel_cls is KdaIntra and config.gate is not None and not config.output_akk_inv and config.l2norm
    assert (config.gate.form, config.gate.g_dtype, config.gate.beta_dtype) == ("safe", "float32", "bfloat16")
    specs = _declared(kernel_cls, config)
    tensors, scalars = args[:len(specs)], args[len(specs):]
    assert [t is None for t in tensors] == [s is None for s in specs]
    assert scalars == (0.3, -4.0)
    chunks = -(-T // 64) if cu is None else 5  # varlen lengths 1, 63, 1, 65: 1 + 1 + 1 + 2 chunks
    assert g_last.shape == (B, chunks, HV, K) and g_last.dtype == torch.float32
    assert tensors[16] is g_last and tensors[3] is raw["g"] and tensors[10] is None  # g_last out, raw g in, no Akk_inv
    assert tensors[14].shape == (HV,) and tensors[15].shape == (HV, K)  # A_log, dt_bias as the kernel indexes them
    for out in (w, u, qg, kg):
        assert out.shape == (B, T, HV, K) and out.dtype == torch.bfloat16


def test_from_raw_precomputed_gate_passes_no_gate_parameters(launches: list) -> None:
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra_from_raw

    raw = _raw(1, 70, 2, 2, g_dtype=torch.bfloat16, beta_dtype=torch.float32)
    chunk_kda_fwd_intra_from_raw(**raw, scale=0.1, A_log=torch.randn(2), lower_bound=-5.0)  # gate not in kernel
    (_, config, args), = launches
    assert config.gate.form == "none" and not config.gate.has_A_log and not config.gate.has_dt_bias
    assert args[14] is None and args[15] is None and args[-1] == 0.0  # no A_log, dt_bias, lower bound


@pytest.mark.parametrize("varlen", [False, True])
def test_recurrence_on_decay_rows(varlen: bool, launches: list) -> None:
    from cula_runtime.cute.kda.recurrence import KdaRecurrence, chunk_kda_fwd_recurrence

    HV = 4
    B, T = (2, 100) if not varlen else (1, 130)
    cu = torch.tensor([0, 1, 64, 65, 130], dtype=torch.int32) if varlen else None
    offsets = torch.tensor([0, 1, 2, 3, 5], dtype=torch.int32) if varlen else None
    chunks = 5 if varlen else 2
    bf = [torch.zeros(B, T, HV, K, dtype=torch.bfloat16) for _ in range(4)]
    Aqk = torch.zeros(B, T, HV, 64, dtype=torch.bfloat16)
    g_last = torch.zeros(B, chunks, HV, K)
    order = torch.tensor([4 - 1, 1, 0, 2], dtype=torch.int32) if varlen else None
    o, ht = chunk_kda_fwd_recurrence(*bf, Aqk, g_last, 0.5, output_final_state=True, cu_seqlens=cu,
                                     chunk_offsets=offsets, block_v=64, gate_per_chunk=True, seq_order=order)
    (kernel_cls, config, args), = launches
    assert kernel_cls is KdaRecurrence and config.gate_per_chunk and config.varlen == varlen
    assert config.longest_first == varlen and args[13] is order
    specs = _declared(kernel_cls, config)
    assert [t is None for t in args[:len(specs)]] == [s is None for s in specs]
    assert args[5] is g_last and (args[12] is offsets if varlen else args[12] is None)
    assert o.shape == (B, T, HV, K) and ht.shape == ((4 if varlen else B), HV, K, K)


def test_recurrence_on_decay_rows_refuses_bad_rows(launches: list) -> None:
    from cula_runtime.cute.kda.recurrence import chunk_kda_fwd_recurrence

    bf = [torch.zeros(1, 130, 2, K, dtype=torch.bfloat16) for _ in range(4)]
    Aqk = torch.zeros(1, 130, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 1, 130], dtype=torch.int32)
    with pytest.raises(ValueError, match="needs chunk_offsets"):
        chunk_kda_fwd_recurrence(*bf, Aqk, torch.zeros(1, 4, 2, K), 0.5, cu_seqlens=cu, gate_per_chunk=True)
    with pytest.raises(ValueError, match="seq_order must be int32"):
        chunk_kda_fwd_recurrence(*bf, Aqk, torch.zeros(1, 2, 2, K), 0.5, cu_seqlens=cu,
                                 chunk_offsets=torch.tensor([0, 1, 4], dtype=torch.int32), gate_per_chunk=True,
                                 seq_order=torch.tensor([1, 0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"gk \(gate_per_chunk\) must be float32 \[1, 3, 2, 128\]"):
        chunk_kda_fwd_recurrence(*bf, Aqk, torch.zeros(1, 4, 2, K), 0.5, gate_per_chunk=True)  # 130 tokens: 3 rows
    assert not launches


@pytest.mark.parametrize("cu", [None, [0, 1, 64, 65, 130]], ids=["fixed", "varlen"])
def test_cutedsl_backend_fused_prepare_chains_the_two_launches(cu, launches: list, monkeypatch) -> None:
    """The backend with CULA_CUTE_INTRA=fused-prepare: no kda_prepare launch; the intra kernel's g_last is the
    recurrence's gate argument, read per chunk; the raw inputs go straight to the intra kernel."""
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl
    from cula_runtime.cute.kda.intra import KdaIntra
    from cula_runtime.cute.kda.recurrence import KdaRecurrence
    from cula_runtime.kda_args import validate_kda_prefill

    monkeypatch.setenv("CULA_CUTE_INTRA", "fused-prepare")
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
    assert intra_config.gate is not None and rec_config.gate_per_chunk and rec_config.has_initial_state
    assert intra_args[0] is args.q and intra_args[3] is args.g and intra_args[4] is args.beta
    assert rec_args[5] is intra_args[16]  # g_last
    assert rec_config.longest_first == (cu is not None)
    if cu is not None:  # the sequences' launch order: longest first (lengths 1, 63, 1, 65)
        assert rec_args[13].tolist() == [3, 1, 0, 2]
    assert rec_args[0] is intra_args[7] and rec_args[1] is intra_args[8]  # qg, kg
    assert rec_args[2] is intra_args[5] and rec_args[3] is intra_args[6] and rec_args[4] is intra_args[9]  # w, u, Aqk
