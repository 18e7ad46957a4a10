"""The Lightning prefill's kernels A (segment states) and B (the scan) on a GPU, against float64 torch (issue 28;
:mod:`cula_runtime.cute.lightning.chunk_states`).

Kernel A: ``seg_state[s] = Σ_j λ^(L-1-j) k_jᵀ v_j`` against :func:`emulate_segment_states` (float64, exact decays)
on random bf16/fp16 k, v: rel-L2 < 4e-3 (the decayed v is rounded once to the operand dtype), and < 1e-4 against
the same sum with the kernel's rounding emulated (decays in fp32, ``bf16(v · decay)``, float64 sums: what is left
is fp32 accumulation). The tokens outside the segments (between them, right after a partial last chunk) are NaN:
a kernel reading them would return NaN. Kernel B: the start states written over ``seg_state`` and the final states
(``final_state`` in either layout, or the pool slots in place, fp32 or bf16) against :func:`emulate_scan` on the
same fp32 inputs: rel-L2 < 1e-5 (bf16 pool: < 4e-3, and within one bf16 rounding of the emulation). A pool with
padding rows (a negative slot, a slot >= P) and slots nobody names: those slots keep their bits, the padding rows'
segments start from zeros. Decays 0 and -8 (head 0 and head 1 of every case). Outputs NaN-poisoned before the
launch; both block_v give the same bits; every launch is repeated and must give the same bits (determinism).

Needs a CUDA GPU of sm_90 / sm_100 / sm_103 and CuTeDSL (marked ``gpu``; skipped elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cula_runtime import cute as cula_cute
from tests.cute.test_lightning_segments import emulate_scan, emulate_segment_states
from tests.helpers import rel_l2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not cula_cute.is_available(),
                       reason="CuTeDSL or TVM-FFI is missing (cula-runtime brings them on Linux x86_64/aarch64)"),
]

K = 128
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class Case:
    name: str
    lens: tuple[int, ...]  # the sequences, laid end to end (fixed length: B equal lengths)
    seg_len: int
    H: int
    gap: int = 0  # NaN token rows between sequences (and after the last), never read
    dtype: torch.dtype = torch.bfloat16


STATES_CASES = [
    Case("fixed-B2-T1000-H4-seg256", (1000, 1000), 256, 4),
    Case("fixed-B1-T64-H2-seg64", (64,), 64, 2),
    Case("fixed-B1-T1-H2-seg64", (1,), 64, 2, gap=7),
    Case("varlen-empty-tails-H3-seg128-gaps", (0, 70, 0, 1030, 1, 200), 128, 3, gap=5),
    Case("varlen-H2-seg4096", (5000, 3, 64, 65), 4096, 2, gap=64),
    Case("fixed-B1-T700-H2-seg512-fp16", (700,), 512, 2, gap=3, dtype=torch.float16),
]


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _g_gamma(H: int, gen: torch.Generator) -> torch.Tensor:
    """Head 0: no decay; head 1: -8 (λ^L underflows to 0); the others in [-0.3, 0]."""
    g = -0.3 * torch.rand(H, generator=gen)
    g[0] = 0.0
    if H > 1:
        g[1] = -8.0
    return g


def _table(case: Case) -> tuple[list[int], list[int], int]:
    """``(rows flat, seq_segments, token rows)`` of the case, with ``gap`` unused rows after every sequence."""
    from cula_runtime.cute.lightning.prefill_backend import segment_table

    table = segment_table(list(case.lens), case.seg_len)
    starts, at = [], 0
    for length in case.lens:
        starts.append(at)
        at += length + case.gap
    rows = list(table.segments)
    for r in range(0, len(rows), 4):  # move each segment to its sequence's start in the gapped token axis
        n = rows[r]
        rows[r + 1] = starts[n] + rows[r + 1] - sum(case.lens[:n])
    return rows, table.seq_segments, at


def _states_inputs(case: Case, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows, offsets, BT = _table(case)
    k = torch.randn(BT, case.H, K, generator=gen).to(case.dtype)
    v = torch.randn(BT, case.H, K, generator=gen).to(case.dtype)
    used = torch.zeros(BT, dtype=torch.bool)
    for r in range(0, len(rows), 4):
        used[rows[r + 1]:rows[r + 1] + rows[r + 2]] = True
    k[~used] = float("nan")
    v[~used] = float("nan")
    segments = torch.tensor(rows, dtype=torch.int32).view(-1, 4)
    return k, v, _g_gamma(case.H, gen), segments, torch.tensor(offsets, dtype=torch.int32)


def emulate_rounded_states(k, v, g_gamma, segments) -> torch.Tensor:
    """Kernel A with its rounding: decays ``2^(fp32(g·log2 e) · steps)`` in fp32, ``v · decay`` rounded to the
    operand dtype, the products summed in float64."""
    H = k.shape[1]
    out = torch.zeros(segments.shape[0], H, K, K, dtype=torch.float64)
    g2 = g_gamma.float() * torch.tensor(LOG2E, dtype=torch.float32)
    for s, (_, start, length, _) in enumerate(segments.tolist()):
        steps = torch.arange(length - 1, -1, -1, dtype=torch.float32)
        decay = torch.exp2(g2.view(1, H) * steps.view(length, 1))  # [L, H]
        vd = (v[start:start + length].float() * decay.unsqueeze(-1)).to(k.dtype).double()
        out[s] = torch.einsum("jhk,jhv->hkv", k[start:start + length].double(), vd)
    return out


@pytest.mark.parametrize("case", STATES_CASES, ids=lambda c: c.name)
def test_segment_states_against_float64(case: Case) -> None:
    from cula_runtime.cute.lightning.chunk_states import lightning_segment_states

    k, v, g_gamma, segments, _ = _states_inputs(case, seed=11)
    dev = _device()
    kd, vd, gd, sd = k.to(dev), v.to(dev), g_gamma.to(dev), segments.to(dev)
    results = []
    for block_v in (128, 64, 128):
        out = torch.full((segments.shape[0], case.H, K, K), float("nan"), device=dev)
        lightning_segment_states(kd, vd, gd, sd, seg_state=out, block_v=block_v)
        results.append(out.cpu())
    torch.cuda.synchronize()
    got = results[0]
    assert torch.isfinite(got).all()
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])  # block_v; determinism
    exact = emulate_segment_states(k, v, g_gamma, segments)
    rounded = emulate_rounded_states(k, v, g_gamma, segments)
    assert rel_l2(got, exact) < 4e-3
    assert rel_l2(got, rounded) < 1e-4
    for s in range(segments.shape[0]):  # no segment is right only on average
        assert rel_l2(got[s], rounded[s]) < 3e-4, s


def test_segment_states_allocates_and_checks() -> None:
    from cula_runtime.cute.lightning.chunk_states import lightning_segment_states

    case = STATES_CASES[0]
    k, v, g_gamma, segments, _ = _states_inputs(case, seed=3)
    dev = _device()
    out = lightning_segment_states(k.to(dev), v.to(dev), g_gamma.to(dev), segments.to(dev))
    assert out.shape == (segments.shape[0], case.H, K, K) and out.dtype == torch.float32
    assert rel_l2(out.cpu(), emulate_segment_states(k, v, g_gamma, segments)) < 4e-3
    with pytest.raises(ValueError, match="g_gamma must be"):
        lightning_segment_states(k.to(dev), v.to(dev), g_gamma.to(dev).double(), segments.to(dev))
    with pytest.raises(ValueError, match="segments must be"):
        lightning_segment_states(k.to(dev), v.to(dev), g_gamma.to(dev), segments.to(dev).long())
    with pytest.raises(ValueError, match="block_v"):
        lightning_segment_states(k.to(dev), v.to(dev), g_gamma.to(dev), segments.to(dev), block_v=32)


@dataclass(frozen=True)
class ScanCase:
    name: str
    lens: tuple[int, ...]
    seg_len: int
    H: int
    h0: bool = False
    final: bool = True
    v_first: bool = False
    pool: str | None = None  # "float32" / "bfloat16"
    slots: tuple[int, ...] | None = None  # per sequence; P = pool slots
    P: int = 0
    flags: tuple[bool, ...] | None = None


SCAN_CASES = [
    ScanCase("fixed-B2-T1000-H4-kv-noh0", (1000, 1000), 256, 4),
    ScanCase("fixed-B3-T300-H2-vk-h0", (300, 300, 300), 64, 2, h0=True, v_first=True),
    ScanCase("varlen-empty-tails-H3-kv-h0", (0, 70, 0, 1030, 1, 200), 128, 3, h0=True),
    ScanCase("varlen-H2-vk-h0-nofinal", (5000, 3, 0, 65), 512, 2, h0=True, final=False, v_first=True),
    ScanCase("fixed-B1-T20000-H2-kv-h0-long", (20000,), 64, 2, h0=True),  # 313 segments: many prefetch groups
    ScanCase("pool-fp32-kv-padding", (100, 0, 700, 64, 129), 64, 2, pool="float32", slots=(3, 0, -1, 7, 5), P=6),
    ScanCase("pool-fp32-vk-flags", (100, 0, 700, 64), 128, 2, v_first=True, pool="float32", slots=(1, 0, 4, 2), P=5,
             flags=(True, False, False, True)),
    ScanCase("pool-bf16-vk-padding-flags", (300, 0, 1, 640), 128, 3, v_first=True, pool="bfloat16",
             slots=(2, -5, 0, 9), P=4, flags=(True, True, False, True)),
    ScanCase("pool-bf16-kv", (64, 65, 2000), 256, 2, pool="bfloat16", slots=(1, 3, 0), P=4),
]


def _scan_inputs(case: ScanCase, seed: int):
    from cula_runtime.cute.lightning.prefill_backend import segment_table

    gen = torch.Generator().manual_seed(seed)
    table = segment_table(list(case.lens), case.seg_len)
    nseg, N, H = table.num_segments, len(case.lens), case.H
    segments = torch.tensor(table.segments, dtype=torch.int32).view(-1, 4)
    seq_segments = torch.tensor(table.seq_segments, dtype=torch.int32)
    own = torch.randn(nseg, H, K, K, generator=gen) * 0.1  # each segment's own state (kernel A's output)
    g_gamma = _g_gamma(H, gen)
    h0 = torch.randn(N, H, K, K, generator=gen) if case.h0 else None
    pool = None if case.pool is None else torch.randn(case.P, H, K, K, generator=gen).to(getattr(torch, case.pool))
    idx = None if case.slots is None else torch.tensor(case.slots, dtype=torch.int32)
    flags = None if case.flags is None else torch.tensor(case.flags)
    return own, segments, seq_segments, g_gamma, h0, pool, idx, flags


def _close(got: torch.Tensor, want: torch.Tensor, bound: float) -> bool:
    """rel-L2 below ``bound``; an all-zero reference (a sequence starting and ending at zeros) wants exact zeros."""
    if not want.abs().sum():
        return bool((got == 0).all())
    return rel_l2(got, want) < bound


@pytest.mark.parametrize("case", SCAN_CASES, ids=lambda c: c.name)
def test_segment_scan_against_float64(case: ScanCase) -> None:
    from cula_runtime.cute.lightning.chunk_states import lightning_segment_scan

    own, segments, seq_segments, g_gamma, h0, pool, idx, flags = _scan_inputs(case, seed=5)
    dev = _device()

    def to(x):
        return None if x is None else x.to(dev)

    runs = []
    for _ in range(2):
        seg_state = own.to(dev, copy=True)  # (a fresh copy per run: both are written in place)
        pool_d = None if pool is None else pool.to(dev, copy=True)
        ht = lightning_segment_scan(seg_state, to(segments), to(seq_segments), to(g_gamma), initial_state=to(h0),
                                    output_final_state=case.final and pool is None, state_v_first=case.v_first,
                                    state=pool_d, state_indices=to(idx), has_initial_state=to(flags))
        runs.append((seg_state.cpu(), None if ht is None else ht.cpu(), None if pool_d is None else pool_d.cpu()))
    torch.cuda.synchronize()
    for a, b in zip(runs[0], runs[1], strict=True):  # determinism
        assert (a is None and b is None) or torch.equal(a, b)
    starts, ht, pool_after = runs[0]
    ref_starts, ref_final, slots = emulate_scan(own, segments, seq_segments, g_gamma, h0, case.v_first, pool, idx,
                                                flags)
    assert _close(starts, ref_starts, 1e-5)
    ref_laid = ref_final.transpose(-1, -2) if case.v_first else ref_final
    if pool is None:
        if case.final:
            assert ht.shape == ref_laid.shape and _close(ht, ref_laid, 1e-5)
        else:
            assert ht is None
        return
    assert ht is None
    named = set()
    for n, slot in enumerate(slots):
        if slot < 0:
            continue
        named.add(slot)
        got, want = pool_after[slot].double(), ref_laid[n]
        if pool.dtype == torch.float32:
            assert _close(got, want, 1e-5), n
        else:  # within one bf16 rounding of the emulation (the final state rounded to nearest even)
            assert _close(got, want, 4e-3), n
            assert ((got - want).abs() <= want.abs() * (2.0**-8 + 1e-5) + 1e-30).all(), n
    for slot in range(pool.shape[0]):
        if slot not in named:
            assert torch.equal(pool_after[slot], pool[slot]), slot  # never named (or a padding row's): unchanged


def test_scan_of_kernel_a_is_the_recurrence() -> None:
    """Kernel A then kernel B: each segment's start state is the fp64 recurrence's state before its first token,
    and the final state the state after the sequence (rel-L2 < 4e-3: A's one bf16 rounding of the decayed v)."""
    from cula_runtime.cute.lightning.chunk_states import lightning_segment_scan, lightning_segment_states

    case = STATES_CASES[3]
    k, v, g_gamma, segments, seq_segments = _states_inputs(case, seed=21)
    dev = _device()
    N = len(case.lens)
    h0 = torch.randn(N, case.H, K, K)
    seg_state = lightning_segment_states(k.to(dev), v.to(dev), g_gamma.to(dev), segments.to(dev))
    ht = lightning_segment_scan(seg_state, segments.to(dev), seq_segments.to(dev), g_gamma.to(dev),
                                initial_state=h0.to(dev), output_final_state=True)
    lam = torch.exp(g_gamma.double()).view(-1, 1, 1)
    rows = segments.tolist()
    offsets = seq_segments.tolist()
    for n in range(N):
        S = h0[n].double()
        for s in range(offsets[n], offsets[n + 1]):
            assert rel_l2(seg_state[s].cpu(), S) < 4e-3, (n, s)
            _, start, length, _ = rows[s]
            for t in range(start, start + length):
                S = lam * S + k[t].double().unsqueeze(-1) * v[t].double().unsqueeze(-2)
        assert rel_l2(ht[n].cpu(), S) < 4e-3, n
