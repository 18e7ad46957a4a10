"""The Lightning prefill's segment table and its host orchestration, on the CPU (issue 28; the design:
``cula_runtime.cute.lightning.prefill_backend``).

* :func:`segment_table` for fixed lengths, varlen batches with empty sequences and tails, against a brute-force
  cut of every sequence; its argument errors; :func:`choose_seg_len` (the examples of its docstring, its rule) and
  a fixed seg_len; the device table's cache (a repeated call builds nothing; an in-place
  change of ``cu_seqlens`` rebuilds).
* ``verify_lightning_prefill``'s declines, each with its reason.
* ``lightning_prefill_cutedsl_backend`` and its call plan with the three kernels replaced by the float64
  emulations below (:func:`emulate_segment_states`, :func:`emulate_scan`, :func:`emulate_chunk_output`), against
  the fp64 token recurrence: the segment table, the flattened views, the allocations and the kernels' order
  reproduce Lightning Attention (fixed and varlen, h0 and ht, both layouts, the pool with padding and untouched
  slots). The emulations are also the GPU tests' references for kernels A and B
  (``tests/cute/test_lightning_states_gpu.py``).
"""

from __future__ import annotations

import types

import pytest
import torch

from cula_runtime.cute.lightning import prefill_backend as pb
from cula_runtime.cute.lightning.prefill_backend import SEG_LEN_CHOICES, choose_seg_len, num_segments, segment_table

# ---- float64 emulations of the three kernels (the design's math, nothing rounded) -----------------------------------


def emulate_segment_states(k: torch.Tensor, v: torch.Tensor, g_gamma: torch.Tensor,
                           segments: torch.Tensor) -> torch.Tensor:
    """Kernel A in float64: ``[NSEG, H, K, V]``, ``Σ_j λ^(L-1-j) k_jᵀ v_j`` over each segment's rows of the flattened
    ``k [B·T, H, K]``, ``v [B·T, H, V]``."""
    H, K, V = k.shape[1], k.shape[2], v.shape[2]
    rows = segments.tolist()
    out = torch.zeros(len(rows), H, K, V, dtype=torch.float64)
    g = g_gamma.double().cpu()
    for s, (_, start, length, _) in enumerate(rows):
        kk = k[start:start + length].double().cpu()
        vv = v[start:start + length].double().cpu()
        steps = torch.arange(length - 1, -1, -1, dtype=torch.float64)
        decay = torch.exp(g.view(H, 1) * steps.view(1, length))  # [H, L]
        out[s] = torch.einsum("jhk,hj,jhv->hkv", kk, decay, vv)
    return out


def start_states(N: int, H: int, K: int, initial_state, state_v_first: bool, pool, state_indices,
                 has_initial_state) -> tuple[torch.Tensor, list[int]]:
    """Each sequence's start state, K-first float64 ``[N, H, K, V]``, and its pool slot (-1: none or padding)."""
    S = torch.zeros(N, H, K, K, dtype=torch.float64)
    slots = [-1] * N
    if initial_state is not None:
        h0 = initial_state.double().cpu()
        S = (h0.transpose(-1, -2) if state_v_first else h0).clone()
    if pool is not None:
        P = pool.shape[0]
        flags = None if has_initial_state is None else has_initial_state.tolist()
        for n, slot in enumerate(state_indices.tolist()):
            if 0 <= slot < P:
                slots[n] = slot
                if flags is None or flags[n]:
                    x = pool[slot].double().cpu()
                    S[n] = x.transpose(-1, -2) if state_v_first else x
    return S, slots


def emulate_scan(seg_state: torch.Tensor, segments: torch.Tensor, seq_segments: torch.Tensor,
                 g_gamma: torch.Tensor, initial_state=None, state_v_first: bool = False, pool=None,
                 state_indices=None, has_initial_state=None,
                 skip_last: bool = False) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Kernel B in float64: ``(start states [NSEG, H, K, V], final states K-first [N, H, K, V], slots)`` from the
    segments' own states ``seg_state``; ``skip_last``: each sequence's last segment's own state is not read (the
    final states of sequences with tokens are then their last segments' start states: kernel C finishes them)."""
    H, K = seg_state.shape[1], seg_state.shape[2]
    offsets = seq_segments.tolist()
    N = len(offsets) - 1
    S, slots = start_states(N, H, K, initial_state, state_v_first, pool, state_indices, has_initial_state)
    lengths = segments[:, 2].tolist()
    g = g_gamma.double().cpu().view(H, 1, 1)
    own = seg_state.double().cpu()
    starts = torch.empty_like(own)
    for n in range(N):
        for s in range(offsets[n], offsets[n + 1]):
            starts[s] = S[n]
            if not (skip_last and s == offsets[n + 1] - 1):
                S[n] = torch.exp(g * lengths[s]) * S[n] + own[s]
    return starts, S, slots


def emulate_chunk_output(q, k, v, g_gamma, seg_state, segments, o, scale: float, seg_len: int,
                         empty_rows: bool = False) -> list[torch.Tensor]:
    """Kernel C in float64 (the token recurrence from each segment's start state), written into ``o``
    (``empty_rows``: the direct form's table, whose empty sequences have rows of length 0); returns each segment's
    state after its tokens (K-first float64 ``[H, K, V]``)."""
    H = q.shape[1]
    g = torch.exp(g_gamma.double().cpu()).view(H, 1, 1)
    ends = []
    for s, (_, start, length, _) in enumerate(segments.tolist()):
        assert (0 if empty_rows else 1) <= length <= seg_len
        S = seg_state[s].double().cpu().clone()
        for t in range(start, start + length):
            S = g * S + k[t].double().cpu().unsqueeze(-1) * v[t].double().cpu().unsqueeze(-2)
            o[t] = (scale * torch.einsum("hk,hkv->hv", q[t].double().cpu(), S)).to(o.dtype)
        ends.append(S)
    return ends


def write_final_states(final: torch.Tensor, state_v_first: bool, ht, pool, slots: list[int],
                       only: list[int] | None = None) -> None:
    """The final states (K-first float64 ``[N, H, K, V]``) into ``ht`` and the pool slots, in their layout
    (``only``: those sequences' alone)."""
    final_laid = final.transpose(-1, -2) if state_v_first else final
    for n, slot in enumerate(slots):
        if only is not None and n not in only:
            continue
        if ht is not None:
            ht[n] = final_laid[n].float()
        if pool is not None and slot >= 0:
            pool[slot] = final_laid[n].to(pool.dtype)


class FakeKernels:
    """Stand-ins for ``chunk_states`` and ``chunk_output`` with the same entry points, computing in float64 and
    recording the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.direct_block_vs: list[int] = []  # the direct form's V block per launch

    # chunk_states' unchecked entries, as the backend runs them (skip_last: the last segments' own states are left
    # as NaN, never read; the scan writes the final states of sequences without tokens only)
    def _states_run(self, k, v, g_gamma, segments, seg_state, block_v, skip_last=False) -> None:
        assert block_v in (64, 128) and seg_state.dtype == torch.float32 and seg_state.is_contiguous()
        assert k.dim() == 3 and v.dim() == 3 and segments.dtype == torch.int32 and skip_last
        self.calls.append(("A", segments.shape[0], block_v))
        own = emulate_segment_states(k, v, g_gamma, segments).float()
        own[segments[:, 3].cpu() != 0] = float("nan")
        seg_state.copy_(own)

    def _scan_run(self, seg_state, segments, seq_segments, g_gamma, initial_state, ht, state_v_first, pool=None,
                  state_indices=None, has_initial_state=None, skip_last=False) -> None:
        assert skip_last
        self.calls.append(("B", seq_segments.shape[0] - 1))
        starts, final, slots = emulate_scan(seg_state, segments, seq_segments, g_gamma, initial_state, state_v_first,
                                            pool, state_indices, has_initial_state, skip_last)
        seg_state.copy_(starts.float())
        offsets = seq_segments.tolist()
        empty = [n for n in range(len(offsets) - 1) if offsets[n] == offsets[n + 1]]
        write_final_states(final, state_v_first, ht, pool, slots, empty)

    def scan_flags(self, initial_state, output_final_state, state_v_first, pool, has_initial_state) -> tuple:
        return (initial_state is not None, bool(output_final_state), bool(state_v_first),
                None if pool is None else str(pool.dtype), has_initial_state is not None)

    def plan_segment_states(self, H, dtype, block_v, device):  # (the backend's form: last segments skipped)
        return lambda k, v, g_gamma, segments, seg_state: self._states_run(k, v, g_gamma, segments, seg_state,
                                                                           block_v, True)

    def plan_segment_scan(self, H, N, flags, device):
        v_first = flags[2]
        return lambda seg_state, segments, seq_segments, g_gamma, h0, ht, pool, idx, has_init: self._scan_run(
            seg_state, segments, seq_segments, g_gamma, h0, ht, v_first, pool, idx, has_init, True)

    def segments_output_run(self, q, k, v, g_gamma, seg_state, segments, o, scale, ht, state_v_first, pool,
                            state_indices) -> None:
        """Kernel C over segments whose last ones write their sequences' final states."""
        assert q.dim() == 3 and o.dim() == 3 and o.shape[0] == q.shape[0]
        self.calls.append(("C", segments.shape[0], None))
        ends = emulate_chunk_output(q, k, v, g_gamma, seg_state, segments, o, scale, q.shape[0])
        rows = segments.tolist()
        N = max((r[0] for r in rows), default=-1) + 1
        final = torch.zeros(N, *ends[0].shape, dtype=torch.float64) if rows else None
        last = [r[0] for r in rows if r[3]]
        for s, r in enumerate(rows):
            if r[3]:
                final[r[0]] = ends[s]
        if pool is not None:
            P = pool.shape[0]
            slots = [int(x) if 0 <= int(x) < P else -1 for x in state_indices.tolist()[:N]]
        else:
            slots = [-1] * N
        if rows and (ht is not None or pool is not None):
            write_final_states(final, state_v_first, ht, pool, slots, last)

    def plan_chunk_output(self, H, device, flags):  # (the bound kernel C of plans: the table's lengths)
        v_first = flags[2]

        def run(q, k, v, g_gamma, seg_state, segments, o, scale, ht=None, pool=None, state_indices=None) -> None:
            assert q.shape[1] == H
            self.segments_output_run(q, k, v, g_gamma, seg_state, segments, o, scale, ht, v_first, pool,
                                     state_indices)
        return run

    # chunk_output's direct form: kernel A's own states, kernel B's scan over one segment per sequence, kernel C
    def direct_output_run(self, q, k, v, g_gamma, segments, o, scale, initial_state, ht, state_v_first, pool,
                          state_indices, has_initial_state, block_v=128) -> None:
        assert q.dim() == 3 and o.dim() == 3 and segments.dtype == torch.int32 and block_v in (64, 128)
        N = segments.shape[0]
        assert segments[:, 0].tolist() == list(range(N))  # one row per sequence, in order
        self.calls.append(("D", N))
        self.direct_block_vs.append(block_v)
        own = emulate_segment_states(k, v, g_gamma, segments)
        starts, final, slots = emulate_scan(own, segments, torch.arange(N + 1, dtype=torch.int32), g_gamma,
                                            initial_state, state_v_first, pool, state_indices, has_initial_state)
        emulate_chunk_output(q, k, v, g_gamma, starts.float(), segments, o, scale, q.shape[0], empty_rows=True)
        write_final_states(final, state_v_first, ht, pool, slots)

    def plan_direct_output(self, H, flags, device, block_v=128):
        v_first = flags[2]

        def run(q, k, v, g_gamma, segments, o, scale, h0, ht, pool, idx, has_init) -> None:
            assert q.shape[1] == H
            self.direct_output_run(q, k, v, g_gamma, segments, o, scale, h0, ht, v_first, pool, idx, has_init,
                                   block_v)
        return run


@pytest.fixture
def fake_kernels(monkeypatch: pytest.MonkeyPatch) -> FakeKernels:
    fake = FakeKernels()
    monkeypatch.setattr(pb, "_states", lambda: fake)
    monkeypatch.setattr(pb, "_kernel_c", lambda: fake)
    monkeypatch.setattr(pb, "sm_count", lambda device: 132)
    pb.clear_segment_cache()
    return fake


# ---- the segment table -----------------------------------------------------------------------------------------------


def brute_force_rows(lens: list[int], seg_len: int) -> list[tuple[int, int, int, int]]:
    rows, start = [], 0
    for n, length in enumerate(lens):
        tokens = list(range(start, start + length))
        for i in range(0, length, seg_len):
            piece = tokens[i:i + seg_len]
            rows.append((n, piece[0], len(piece), int(piece[-1] == tokens[-1])))
        start += length
    return rows


@pytest.mark.parametrize(("lens", "seg_len"), [
    pytest.param([4096], 512, id="fixed-B1-T4096-seg512"),
    pytest.param([1000, 1000, 1000], 256, id="fixed-B3-T1000-seg256-tails"),
    pytest.param([1], 64, id="fixed-B1-T1"),
    pytest.param([63, 63], 64, id="fixed-B2-T63"),
    pytest.param([0, 0], 64, id="fixed-B2-T0"),
    pytest.param([0, 100, 0, 128, 1, 4097, 0], 128, id="varlen-empty-and-tails-seg128"),
    pytest.param([15, 85, 200, 900], 64, id="varlen-seg64"),
    pytest.param([5000, 3, 64, 65], 4096, id="varlen-seg4096"),
])
def test_segment_table_cuts_every_sequence_in_order(lens: list[int], seg_len: int) -> None:
    table = segment_table(lens, seg_len)
    assert table.rows() == brute_force_rows(lens, seg_len)
    assert table.num_segments == num_segments(lens, seg_len) == len(table.segments) // 4
    offsets = table.seq_segments
    assert len(offsets) == len(lens) + 1 and offsets[0] == 0 and offsets[-1] == table.num_segments
    rows = table.rows()
    starts = [sum(lens[:n]) for n in range(len(lens))]
    for n, length in enumerate(lens):
        mine = rows[offsets[n]:offsets[n + 1]]
        assert all(r[0] == n for r in mine)
        assert sum(r[2] for r in mine) == length  # every token once, in order
        assert [r[1] for r in mine] == [starts[n] + i * seg_len for i in range(len(mine))]
        assert all(r[2] == seg_len for r in mine[:-1]) and all(1 <= r[2] <= seg_len for r in mine)
        assert (length == 0) == (not mine)  # an empty sequence has no segment
        assert [r[3] for r in mine] == [0] * (len(mine) - 1) + [1] * bool(mine)  # its last one marked


def test_segment_table_docstring_example() -> None:
    table = segment_table([130, 0, 64], 64)
    assert table.rows() == [(0, 0, 64, 0), (0, 64, 64, 0), (0, 128, 2, 1), (2, 130, 64, 1)]
    assert table.seq_segments == [0, 3, 3, 4]


@pytest.mark.parametrize(("lens", "seg_len", "error", "match"), [
    ([10], 0, ValueError, "seg_len must be a positive multiple of 64"),
    ([10], 100, ValueError, "seg_len must be a positive multiple of 64"),
    ([10], -64, ValueError, "seg_len"),
    ([10], 64.0, TypeError, "seg_len must be an int"),
    ([10], True, TypeError, "seg_len must be an int"),
    ([10, -1], 64, ValueError, r"lens\[1\] must be >= 0"),
    ([10, 2.5], 64, TypeError, r"lens\[1\] must be an int"),
])
def test_segment_table_says_what_is_wrong(lens, seg_len, error, match) -> None:
    with pytest.raises(error, match=match):
        segment_table(lens, seg_len)


@pytest.mark.parametrize(("B", "H", "T", "expected"), [
    (1, 16, 32768, 4096), (1, 64, 4096, 2048), (2, 64, 32768, 4096), (1, 16, 4096, 512), (2, 16, 32768, 4096),
    (1, 16, 16384, 2048), (2, 16, 4096, 1024), (1, 16, 100, 64), (1, 1, 64, 64), (1, 64, 1024, 512),
])
def test_choose_seg_len_examples(B: int, H: int, T: int, expected: int) -> None:
    assert choose_seg_len([T] * B, H, 132) == expected


@pytest.mark.parametrize("lens", [[32768], [4096, 4096], [100] * 20, [0, 7000, 12, 300, 20000], [0], [1] * 3])
@pytest.mark.parametrize("H", [1, 16, 64])
def test_choose_seg_len_rule(lens: list[int], H: int) -> None:
    sms = 132
    seg_len = choose_seg_len(lens, H, sms)
    assert seg_len in SEG_LEN_CHOICES
    ctas = num_segments(lens, seg_len) * H
    wave = pb.WAVE_FILL * sms
    assert all(num_segments(lens, s) * H < wave for s in SEG_LEN_CHOICES if s > seg_len)  # no longer one fills it
    assert ctas >= wave or seg_len == SEG_LEN_CHOICES[-1]  # it fills the wave, or nothing does


def test_seg_len_fixed_by_the_caller() -> None:
    assert pb._requested_seg_len(0) == 0  # chosen per call
    assert pb._requested_seg_len(192) == 192
    for bad in (100, -64, 1 << 30):
        with pytest.raises(ValueError, match="seg_len must be a positive multiple of 64"):
            pb._requested_seg_len(bad)
    with pytest.raises(TypeError, match="seg_len must be an int"):
        pb._requested_seg_len("640")


def test_device_table_is_cached() -> None:
    pb.clear_segment_cache()
    cpu = torch.device("cpu")
    first = pb.device_segments(2, 1000, 16, None, cpu, 132)
    assert pb.device_segments(2, 1000, 16, None, cpu, 132) is first  # fixed length: built once
    seg_len, segments, seq_segments, direct, block_v = first
    assert not direct and block_v == 128  # 1000 tokens > the chosen 256: cut into segments
    assert segments.dtype == seq_segments.dtype == torch.int32 and segments.is_contiguous()
    assert [tuple(r) for r in segments.tolist()] == segment_table([1000, 1000], seg_len).rows()
    assert seq_segments.tolist() == segment_table([1000, 1000], seg_len).seq_segments
    assert pb.device_segments(2, 1000, 16, None, cpu, 132, 128)[0] == 128

    cu = torch.tensor([0, 0, 100, 228, 1000], dtype=torch.int32)
    table = pb.device_segments(1, 1000, 4, cu, cpu, 132, 64)
    assert pb.device_segments(1, 1000, 4, cu, cpu, 132, 64) is table  # per tensor and version
    assert table[1].tolist() == [list(r) for r in segment_table([0, 100, 128, 772], 64).rows()]
    assert table[2].tolist() == [0, 0, 2, 4, 17]
    cu[2] = 150  # an in-place change: a new version, a new table
    again = pb.device_segments(1, 1000, 4, cu, cpu, 132, 64)
    assert again is not table and again[2].tolist() == segment_table([0, 150, 78, 772], 64).seq_segments


def test_direct_table_has_one_row_per_sequence() -> None:
    assert pb.direct_table([130, 0, 64]) == [0, 0, 130, 0, 1, 130, 0, 0, 2, 130, 64, 0]
    assert pb.direct_table([]) == []
    with pytest.raises(ValueError, match=r"lens\[1\] must be >= 0"):
        pb.direct_table([3, -1])


@pytest.mark.parametrize(("lens", "seg_len", "direct", "expected"), [
    ([1000, 1000], 1024, None, True),  # every sequence fits one segment
    ([1000, 1025], 1024, None, False),  # one does not, and 2 sequences x 1 head leave the SMs idle
    ([0, 64, 0], 64, None, True),  # empty sequences fit anywhere
    ([1000, 1025], 1024, True, True),  # forced
    ([10, 10], 4096, False, False),  # forced off
    ([0, 0], 64, None, False),  # no tokens: never (nothing for kernel C to read)
    ([0, 0], 64, True, False),
])
def test_direct_form_decision(lens: list[int], seg_len: int, direct: bool | None, expected: bool) -> None:
    assert pb.uses_direct_form(lens, seg_len, 1, 132, direct) is expected


@pytest.mark.parametrize(("lens", "seg_len", "H", "sms", "expected"), [
    ([16384] * 2, 4096, 64, 132, True),  # B2 H64 T16384: 128 CTAs, the longest 1.03 x the tokens per SM
    ([32768] * 2, 4096, 64, 132, True),
    ([32768] * 2, 4096, 16, 132, False),  # B2 H16: 32 sequence-heads, in half-V CTAs 4.1 x
    ([4147, *[1359] * 9], 4096, 64, 132, True),  # 10 packed sequences, one cut by 4096: 0.52 x
    ([125] * 80, 64, 1, 100, True),  # exactly at the ratio: 125 x 100 = 1.25 x 10000 tokens
    ([126] + [125] * 79, 64, 1, 100, False),  # one token over it
])
def test_direct_form_where_it_keeps_the_sms_busy(lens: list[int], seg_len: int, H: int, sms: int,
                                                 expected: bool) -> None:
    """Beyond one segment per sequence: the longest sequence against DIRECT_LOAD_RATIO x the tokens per SM (these
    rows have too many sequence-heads for half-V CTAs)."""
    assert pb.DIRECT_LOAD_RATIO == 1.25  # (the boundary rows' arithmetic)
    assert pb.choose_direct_block_v(lens, H, sms) == 128 or not expected
    assert pb.uses_direct_form(lens, seg_len, H, sms) is expected


@pytest.mark.parametrize(("lens", "H", "sms", "block_v", "expected"), [
    ([4096], 64, 132, 64, True),  # B1 H64: 128 half-V CTAs, the longest 2.06 x the tokens per SM
    ([32768], 64, 132, 64, True),
    ([4096], 32, 132, 64, False),  # B1 H32: 64 half-V CTAs, 4.1 x
    ([4096, 0, 0], 66, 132, 64, True),  # empty sequences take no SM: 2 x 66 CTAs = 132
    ([4096, 1], 66, 132, 128, False),  # 264 half-V CTAs would share SMs: V block 128, 1.99 x > 1.25
    ([300, 200], 1, 4, 64, True),  # exactly at the half-V ratio: 300 x 4 = 2.4 x 500 tokens
    ([301, 199], 1, 4, 64, False),  # one token over it
    ([16384], 56, 132, 64, True),  # 2.36 x (0.95x the three launches' time on an H100)
    ([16384], 48, 132, 64, False),  # 2.75 x (0.98x: left to the segments)
])
def test_the_direct_form_in_half_v_ctas(lens: list[int], H: int, sms: int, block_v: int, expected: bool) -> None:
    """Where two 4-warp CTAs per sequence-head each get an SM, the direct form runs in them and may take longer
    sequences: up to HALF_V_LOAD_RATIO x the tokens per SM."""
    assert pb.HALF_V_LOAD_RATIO == 2.4  # (the boundary rows' arithmetic)
    assert pb.choose_direct_block_v(lens, H, sms) == block_v
    assert pb.uses_direct_form(lens, 64, H, sms) is expected


def test_the_direct_form_s_v_block_is_checked() -> None:
    with pytest.raises(ValueError, match="direct_block_v must be 0 .* 64 or 128, got 32"):
        pb._requested_block_v(32)


def test_device_table_of_the_direct_form() -> None:
    pb.clear_segment_cache()
    cpu = torch.device("cpu")
    # B16 H8 T300 on 132 SMs: 4096-token segments fill the wave (128 CTAs), every sequence fits one: direct
    seg_len, segments, seq_segments, direct, block_v = pb.device_segments(16, 300, 8, None, cpu, 132)
    assert (seg_len, direct, seq_segments, block_v) == (4096, True, None, 128)
    assert segments.tolist() == [[b, 300 * b, 300, 0] for b in range(16)]
    assert not pb.device_segments(16, 300, 8, None, cpu, 132, direct=False).direct  # cached apart
    assert pb.device_segments(16, 300, 8, None, cpu, 132).direct
    cu = torch.tensor([0, 0, 100, 228, 1000], dtype=torch.int32)
    table = pb.device_segments(1, 1000, 4, cu, cpu, 132, 64, direct=True)
    assert table.direct and table.seq_segments is None
    assert table.segments.tolist() == [[0, 0, 0, 0], [1, 0, 100, 0], [2, 100, 128, 0], [3, 228, 772, 0]]
    assert table.block_v == 64  # 3 sequences with tokens x 4 heads x 2 <= 132 SMs
    forced = pb.device_segments(1, 1000, 4, cu, cpu, 132, 64, direct=True, block_v=128)
    assert forced.direct and forced.block_v == 128 and forced is not table  # cached apart
    # B1 H64 T32768: the direct form in half-V CTAs; the segments form keeps V block 128
    assert pb.device_segments(1, 32768, 64, None, cpu, 132)[3:] == (True, 64)
    assert pb.device_segments(1, 32768, 64, None, cpu, 132, direct=False)[3:] == (False, 128)


# ---- verify -------------------------------------------------------------------------------------------------------


def _args(**changes) -> types.SimpleNamespace:
    q = torch.empty(1, 8, 2, 128, dtype=torch.bfloat16)
    fields = dict(q=q, K=128, V=128, H=2, N=1, initial_state=None, state=None, device=torch.device("cuda", 0))
    fields.update(changes)
    return types.SimpleNamespace(**fields)


@pytest.mark.parametrize(("changes", "reason"), [
    (dict(device=torch.device("cpu")), "needs CUDA tensors"),
    (dict(q=torch.empty(1, 8, 2, 128, dtype=torch.float16)), "needs bf16 q/k/v"),
    (dict(q=torch.empty(1, 8, 2, 128, dtype=torch.float32)), "needs bf16 q/k/v"),
    (dict(K=64), "needs K = V = 128"),
    (dict(V=64), "needs K = V = 128"),
    (dict(H=70000), "H <= 65535"),
    (dict(initial_state=torch.empty(1, 2, 128, 128, dtype=torch.float64)), "fp32 initial_state"),
    (dict(state=torch.empty(3, 2, 128, 128, dtype=torch.float16)), "fp32 or bf16 state pool"),
    (dict(state=torch.empty(3, 2, 128, 128).transpose(-1, -2)), "heads compact"),
    (dict(state=torch.empty(3, 2, 128, 130)[..., :128]), "heads compact"),
    (dict(state=torch.empty(3 * 2 * 128 * 128 + 3 * 6).as_strided((3, 2, 128, 128), (2 * 128 * 128 + 6, 128 * 128,
                                                                                       128, 1))), "slot stride"),
    (dict(state=torch.empty(2 * 128 * 128 + 1)[1:].view(1, 2, 128, 128)), "aligned"),
])
def test_verify_declines_with_reasons(monkeypatch: pytest.MonkeyPatch, changes: dict, reason: str) -> None:
    monkeypatch.setattr("cula_runtime.cute.is_available", lambda: True)
    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: (9, 0))
    assert pb.verify_lightning_prefill(_args()) == (True, "CuTeDSL kernels serve this call (segment states, scan, "
                                                          "output)")
    ok, why = pb.verify_lightning_prefill(_args(**changes))
    assert not ok and reason in why, why


@pytest.mark.parametrize(("capability", "ok"), [((9, 0), True), ((10, 0), True), ((10, 3), True), ((8, 0), False),
                                                ((12, 0), False)])
def test_verify_targets(monkeypatch: pytest.MonkeyPatch, capability, ok: bool) -> None:
    monkeypatch.setattr("cula_runtime.cute.is_available", lambda: True)
    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: capability)
    got, why = pb.verify_lightning_prefill(_args())
    assert got == ok and (ok or "sm_90a/sm_100a/sm_103a" in why)


def test_verify_without_cutedsl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cula_runtime.cute.is_available", lambda: False)
    monkeypatch.setattr("cula_runtime.cute.unavailable_reason", lambda: "pip install it")
    assert pb.verify_lightning_prefill(_args()) == (False, "needs CuTeDSL and TVM-FFI: pip install it")


# ---- the backend's orchestration with emulated kernels ---------------------------------------------------------------


def _inputs(B: int, T: int, H: int, seed: int, cu=None):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, 128, generator=gen).to(torch.bfloat16) for _ in range(3))
    g_gamma = -torch.rand(H, generator=gen) * 0.2
    g_gamma[0] = 0.0
    return q, k, v, g_gamma, None if cu is None else torch.tensor(cu, dtype=torch.int32)


def _oracle(q, k, v, g_gamma, scale, h0, cu, v_first):
    from cula_runtime.reference.lightning import lightning_naive

    return lightning_naive(q, k, v, g_gamma, scale, initial_state=h0, output_final_state=True,
                           cu_seqlens=cu, state_v_first=v_first)


@pytest.mark.parametrize(("B", "T", "H", "cu", "h0", "v_first", "seg_len"), [
    pytest.param(2, 200, 2, None, True, False, 64, id="fixed-B2-T200-h0-kv-seg64"),
    pytest.param(1, 300, 3, None, False, True, 128, id="fixed-B1-T300-vk-seg128"),
    pytest.param(1, 300, 2, (0, 0, 70, 70, 199, 300), True, True, 64, id="varlen-empty-tails-h0-vk"),
    pytest.param(1, 130, 2, (0, 1, 130), False, False, 0, id="varlen-chosen-seg_len"),
    pytest.param(16, 70, 8, None, True, True, 0, id="fixed-B16-T70-H8-h0-vk-fills-the-wave"),
])
@pytest.mark.parametrize("direct", [None, True], ids=["auto", "direct"])
@pytest.mark.parametrize("planned", [False, True], ids=["call", "plan"])
def test_backend_reproduces_the_recurrence(fake_kernels: FakeKernels, B, T, H, cu, h0, v_first, seg_len,
                                           direct: bool | None, planned: bool,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Both forms: the three launches where a sequence is cut into segments (the final states from kernel C's last
    segments, kernel A skipping them), the direct form (one launch) where every sequence fits one (B16 H8: 128 CTAs
    fill the wave uncut) or where it is forced."""
    from cula_runtime.lightning_args import validate_lightning_prefill

    q, k, v, g_gamma, cu_t = _inputs(B, T, H, 1, cu)
    N = B if cu is None else len(cu) - 1
    initial = torch.randn(N, H, 128, 128) if h0 else None
    args = validate_lightning_prefill(q, k, v, g_gamma, initial_state=initial, output_final_state=True,
                                      cu_seqlens=cu_t, state_v_first=v_first)
    if planned:
        plan = pb.plan_lightning_prefill(args, seg_len=seg_len, direct=direct)
        o, ht = plan(args.q, args.k, args.v, args.g_gamma, args.initial_state, args.cu_seqlens, None, None, None)
    else:
        o, ht = pb.lightning_prefill_cutedsl_backend(args, seg_len=seg_len, direct=direct)
    ref_o, ref_ht = _oracle(q, k, v, g_gamma, args.scale, initial, cu_t, v_first)
    assert o.dtype == torch.bfloat16 and o.shape == (B, T, H, 128)
    assert ht.dtype == torch.float32 and ht.shape == args.state_shape
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ht.double(), ref_ht, rtol=1e-5, atol=1e-4)
    one_launch = direct or B == 16
    assert [c[0] for c in fake_kernels.calls] == (["D"] if one_launch else ["A", "B", "C"])
    # the direct form's V block: half-V CTAs where twice the sequence-heads fit the 132 SMs (B16 H8: 256 do not)
    assert fake_kernels.direct_block_vs == ([128 if B == 16 else 64] if one_launch else [])


def test_a_plan_refuses_a_misaligned_q_before_any_kernel(fake_kernels: FakeKernels) -> None:
    """Kernel C, bound in a plan, would refuse a q off its 16-byte rows only after kernel B had written the final
    states or the pool; the plan checks q first: ``LaunchDeclined`` with nothing launched (the caller then runs the
    call unplanned, which copies q)."""
    from cula_runtime.cute.compile_cache import LaunchDeclined
    from cula_runtime.lightning_args import validate_lightning_prefill

    q, k, v, g_gamma, _ = _inputs(1, 128, 2, 1, None)
    args = validate_lightning_prefill(q, k, v, g_gamma, output_final_state=True)
    plan = pb.plan_lightning_prefill(args)
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)  # (2 bytes off its allocation)
    shifted.copy_(q)
    with pytest.raises(LaunchDeclined):
        plan(shifted, args.k, args.v, args.g_gamma, None, None, None, None, None)
    assert fake_kernels.calls == []
    o, _ = plan(q, args.k, args.v, args.g_gamma, None, None, None, None, None)
    assert [c[0] for c in fake_kernels.calls] == ["A", "B", "C"] and fake_kernels.calls[-1][2] is None


def test_a_plan_launches_kernel_c_bound_on_the_wrappers_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan's kernel C launch (``plan_chunk_output``) gets what ``segments_output_run`` passes: q, k, v and o as
    ``[1, B·T, H, 128]`` views of the call's own tensors, the decays, the scan's start states, the segment table,
    ``ht`` (its last segments writing the final states) and the scale; kernels A and B before it, both skipping the
    last segments; nothing compiled here."""
    from cula_runtime import cute as cula_cute

    if not cula_cute.is_available():
        pytest.skip("CuTeDSL or TVM-FFI is not installed")
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput
    from cula_runtime.lightning_args import validate_lightning_prefill
    from tests.cute.compile_helpers import record_launches

    launches = record_launches(monkeypatch)
    monkeypatch.setattr(pb, "sm_count", lambda device: 132)
    pb.clear_segment_cache()
    q, k, v, g_gamma, cu = _inputs(1, 300, 2, 1, (0, 0, 70, 70, 199, 300))
    args = validate_lightning_prefill(q, k, v, g_gamma, output_final_state=True, cu_seqlens=cu)
    plan = pb.plan_lightning_prefill(args)
    o, ht = plan(args.q, args.k, args.v, args.g_gamma, None, args.cu_seqlens, None, None, None)
    assert len(launches) == 3
    (a_cls, a_config, a_args), (_, b_config, b_args), (c_cls, c_config, c_args) = launches
    assert a_config.skip_last and b_config.skip_last  # the last segments are kernel C's
    assert c_cls is LightningChunkOutput and c_config.num_heads == 2
    assert len(c_args) == len(LightningChunkOutput(c_config).argument_specs()) + 1
    for got, want in zip(c_args[:3] + c_args[6:7], (args.q, args.k, args.v, o), strict=True):
        assert got.shape == (1, 300, 2, 128) and got.data_ptr() == want.data_ptr()
    assert c_args[3] is args.g_gamma and c_args[4] is b_args[0] and c_args[5] is b_args[1]  # start states, table
    assert c_args[8] is ht and c_config.output_final_state  # the last segments write the final states
    assert c_args[7] is None and c_args[9:12] == (None,) * 3  # no h0, no pool
    assert c_args[12] == args.scale
    assert b_args[5] is ht  # (kernel B: the final states of sequences without tokens)


def test_a_varlen_plan_takes_the_form_of_each_call(fake_kernels: FakeKernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """One plan, packed batches whose boundaries change between calls: the form follows each call's table (7 SMs,
    H = 4: 4 sequences fill the wave uncut; one 1200-token sequence alone is cut into 1024-token segments: 8 half-V
    CTAs would not get an SM each), the outputs and final states each call's recurrence."""
    from cula_runtime.lightning_args import validate_lightning_prefill

    monkeypatch.setattr(pb, "sm_count", lambda device: 7)
    pb.clear_segment_cache()
    plan = None
    for bounds, form in (((0, 100, 300, 1000, 1200), ["D"]), ((0, 1200, 1200, 1200, 1200), ["A", "B", "C"]),
                         ((0, 300, 600, 900, 1200), ["D"])):
        q, k, v, g_gamma, cu = _inputs(1, 1200, 4, 2, bounds)
        args = validate_lightning_prefill(q, k, v, g_gamma, output_final_state=True, cu_seqlens=cu)
        plan = plan or pb.plan_lightning_prefill(args)
        fake_kernels.calls.clear()
        o, ht = plan(args.q, args.k, args.v, args.g_gamma, None, args.cu_seqlens, None, None, None)
        assert [c[0] for c in fake_kernels.calls] == form, bounds
        ref_o, ref_ht = _oracle(q, k, v, g_gamma, args.scale, None, cu, False)
        torch.testing.assert_close(o.double(), ref_o, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(ht.double(), ref_ht, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pool_dtype", [None, torch.float32, torch.bfloat16], ids=["h0-ht", "fp32-pool", "bf16-pool"])
@pytest.mark.parametrize("planned", [False, True], ids=["call", "plan"])
def test_the_direct_launch_gets_the_call_s_tensors(pool_dtype, planned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real direct-form launch (``chunk_output.direct_output_run`` / ``plan_direct_output``; nothing compiled
    here): kernel C alone, its configuration's state fields from the call, no ``seg_state``, the table's one row per
    sequence (the empty one's of length 0), h0 / ht or the pool, its slots and the bytes of ``has_initial_state``
    at their positions, the scale last."""
    from cula_runtime import cute as cula_cute

    if not cula_cute.is_available():
        pytest.skip("CuTeDSL or TVM-FFI is not installed")
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput
    from cula_runtime.lightning_args import validate_lightning_prefill
    from tests.cute.compile_helpers import record_launches

    launches = record_launches(monkeypatch)
    monkeypatch.setattr(pb, "sm_count", lambda device: 132)
    pb.clear_segment_cache()
    bounds = (0, 0, 70, 70, 199, 300)
    q, k, v, g_gamma, cu = _inputs(1, 300, 2, 1, bounds)
    N = len(bounds) - 1
    if pool_dtype is None:
        h0 = torch.randn(N, 2, 128, 128)
        kwargs = dict(initial_state=h0, output_final_state=True, state_v_first=True)
    else:
        pool = torch.randn(7, 2, 128, 128).to(pool_dtype)
        idx = torch.tensor([3, -1, 0, 6, 5], dtype=torch.int32)
        has = torch.tensor([True, True, False, True, True])
        kwargs = dict(state=pool, state_indices=idx, has_initial_state=has)
    args = validate_lightning_prefill(q, k, v, g_gamma, cu_seqlens=cu, **kwargs)
    if planned:
        plan = pb.plan_lightning_prefill(args, direct=True)
        o, ht = plan(args.q, args.k, args.v, args.g_gamma, args.initial_state, args.cu_seqlens, args.state,
                     args.state_indices, args.has_initial_state)
    else:
        o, ht = pb.lightning_prefill_cutedsl_backend(args, direct=True)
    (cls, config, call), = launches
    assert cls is LightningChunkOutput and config.direct and config.num_heads == 2
    assert config.block_v == 64  # 4 sequences with tokens x 2 heads: half-V CTAs
    assert (config.has_initial_state, config.output_final_state) == (pool_dtype is None, pool_dtype is None)
    assert config.state_pool == (pool_dtype is not None) and config.state_v_first == (pool_dtype is None)
    assert config.state_dtype == ("float32" if pool_dtype is None else str(pool_dtype).removeprefix("torch."))
    assert config.initial_state_flags == (pool_dtype is not None)
    assert len(call) == len(LightningChunkOutput(config).argument_specs()) + 1
    for got, want in zip(call[:3] + call[6:7], (args.q, args.k, args.v, o), strict=True):
        assert got.shape == (1, 300, 2, 128) and got.data_ptr() == want.data_ptr()
    assert call[3] is args.g_gamma and call[4] is None
    assert call[5].tolist() == [[0, 0, 0, 0], [1, 0, 70, 0], [2, 70, 0, 0], [3, 70, 129, 0], [4, 199, 101, 0]]
    if pool_dtype is None:
        assert call[7] is args.initial_state and call[8] is ht and call[9:12] == (None, None, None)
    else:
        assert call[7] is None and call[8] is None and ht is None
        assert call[9] is args.state and call[10] is args.state_indices
        assert call[11].dtype == torch.uint8 and call[11].data_ptr() == args.has_initial_state.data_ptr()
    assert call[12] == args.scale


@pytest.mark.parametrize("direct", [False, True], ids=["segments", "direct"])
def test_backend_pool(fake_kernels: FakeKernels, direct: bool) -> None:
    """The pool form, in both forms (over segments the final states from kernel C's last segments):
    slots read and written in place (fp32), a padding row (-1) and an out-of-pool slot start from zeros and write
    nothing, a False flag starts from zeros but writes its slot, an empty sequence writes its start state back,
    unnamed slots keep their bits."""
    from cula_runtime.lightning_args import validate_lightning_prefill

    cu = (0, 50, 50, 180, 200, 260)
    q, k, v, g_gamma, cu_t = _inputs(1, 260, 2, 2, cu)
    pool = torch.randn(6, 2, 128, 128)
    before = pool.clone()
    idx = torch.tensor([4, 1, -1, 0, 2], dtype=torch.int32)
    flags = torch.tensor([True, True, True, False, True])
    args = validate_lightning_prefill(q, k, v, g_gamma, cu_seqlens=cu_t, state=pool, state_indices=idx,
                                      has_initial_state=flags)
    o, ht = pb.lightning_prefill_cutedsl_backend(args, seg_len=64, direct=direct)
    assert ht is None
    assert [c[0] for c in fake_kernels.calls] == (["D"] if direct else ["A", "B", "C"])
    h0 = torch.stack([before[4], before[1], torch.zeros(2, 128, 128), torch.zeros(2, 128, 128), before[2]])
    ref_o, ref_ht = _oracle(q, k, v, g_gamma, args.scale, h0, cu_t, False)
    torch.testing.assert_close(o.double(), ref_o, rtol=1e-2, atol=1e-2)
    for n, slot in enumerate([4, 1, -1, 0, 2]):
        if slot >= 0:
            torch.testing.assert_close(pool[slot].double(), ref_ht[n], rtol=1e-5, atol=1e-4)
    for slot in (3, 5):  # not named: bit-unchanged
        assert torch.equal(pool[slot], before[slot])


def test_backend_without_tokens(fake_kernels: FakeKernels) -> None:
    """T = 0: no segment, no kernel A or C; kernel B still writes each final state (its start state)."""
    from cula_runtime.lightning_args import validate_lightning_prefill

    q, k, v, g_gamma, _ = _inputs(2, 0, 2, 3)
    h0 = torch.randn(2, 2, 128, 128)
    args = validate_lightning_prefill(q, k, v, g_gamma, initial_state=h0, output_final_state=True)
    o, ht = pb.lightning_prefill_cutedsl_backend(args, direct=True)  # (never the direct form without tokens)
    assert o.shape == (2, 0, 2, 128) and torch.equal(ht, h0)
    assert [c[0] for c in fake_kernels.calls] == ["B"]
