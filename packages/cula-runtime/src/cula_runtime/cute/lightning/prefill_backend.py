"""The ``cutedsl`` backend of ``lightning_prefill``: the segment table, then three CuTeDSL launches (issue 28).

Every sequence is cut into segments of ``seg_len`` tokens (a multiple of the chunk, 64; a sequence's last segment
may be shorter), chosen per call so that the segment-parallel grids fill the GPU (:func:`choose_seg_len`). Then:

1. kernel A (:mod:`.chunk_states`): each segment's own state from zero, fp32 ``seg_state [NSEG, H, K, V]``, but
   for each sequence's last segment (``skip_last``: its own state would only feed the final state);
2. kernel B (:mod:`.chunk_states`): the scan over each sequence's segments: the start states (``initial_state``, a
   pool slot, or zeros) in, each segment's START state written over its own in ``seg_state``; the final states
   (``final_state``, or back into the pool in place) of sequences without tokens only;
3. kernel C (:mod:`.chunk_output`): each segment's outputs from its start state; each sequence's last segment also
   steps its state over its last (partial) chunk and writes the final state (``final_state`` or the pool slot).

Final states from kernel C (lever 5 of ``docs/lightning_notes.md``): kernel A reads 1 / segments-per-sequence less
of k and v, and the final states come from kernel C's FFMA state step, as in the direct form. Timed on a lent H100
against the final states from kernel B (kernel A over every segment; the form is in the history, 1db471f):
0.79-0.99x its time on every row, o the same bits, the final states' error 0.24-0.94x
(``benchmarks/results/lightning_last_segment_ab_h100.md``).

Where every sequence fits in one segment of the chosen length (many sequences, or many heads: the grid fills the GPU
without cutting any), or where no sequence is much longer than the tokens per SM (:func:`uses_direct_form`), the
**direct form** runs instead: kernel C alone, one CTA per (sequence, head) (or two half-V CTAs of 64 value columns
each where twice the sequence-heads still get an SM each: :func:`choose_direct_block_v`), starting from
the sequence's initial state (h0, its pool slot, or zeros) and ending by writing its final state (``final_state`` or
the pool slot) itself; no segment states, no scan: q, k, v read once, one launch. Its table has one row per
sequence, empty ones too (``direct_table``), and no ``seq_segments``.

The segment table (:func:`segment_table`, built on the host from B and T or from the checked host copy of
``cu_seqlens``, then one copy to the device; cached per ``(cu_seqlens tensor, version)`` or per ``(B, T)``):
``segments`` int32 ``[NSEG, 4]``, row s = (sequence n, first token's row in the flattened token axis ``[B·T]``,
length ``1 <= L_s <= seg_len``, 1 on the sequence's last segment else 0), and ``seq_segments`` int32 ``[N + 1]``,
sequence n's rows ``seq_segments[n] .. seq_segments[n + 1] - 1`` in order. A sequence without tokens has no
segments. The token tensors are passed flattened (views): q, k ``[B·T, H, K]``, v, o ``[B·T, H, V]``.

Importing this module imports neither CuTeDSL nor TVM-FFI; the kernel modules load on the first call.

Where it has run: on sm_90 (H200, 2026-12-02): kernels A, B and C against float64
(``tests/cute/test_lightning_states_gpu.py``, ``tests/cute/test_lightning_output_gpu.py``) and this backend through
``cula.lightning.lightning_prefill`` against the fp64 recurrence (``tests/gpu/test_lightning_gpu.py``); timed against
FLA in ``benchmarks/results/lightning_h200.md``. The direct form and kernel C's FFMA state step: on sm_90 (a lent H100,
2026-12-07): the same tests, compute-sanitizer and 10^5 replays of the direct form
(``benchmarks/results/lightning_safety_h100.md``), timed in ``lightning_prefill_forms_ab_h100.md`` and beside FLA in
``lightning_prefill_bench_h100.md``. Its half-V CTAs (V block 64): on sm_90 (a lent H100, 2026-12-07, thirty-second
session): the same GPU tests, compute-sanitizer and 10^5 replays, timed in ``lightning_prefill_forms_ab_h100.md``.
The final states from kernel C over segments: on sm_90 (a lent H100, 2026-12-07, thirty-fifth session) the forms
test against float64 on 16 cases and compute-sanitizer at ``prefill-large``, before it became the only form; the
whole Lightning GPU suite and compute-sanitizer at ``prefill-large-pool`` after (thirty-sixth session). Compiled for
sm_100a and sm_103a in CI, where no GPU has run them.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from ...graph_pools import built_outside_graph_pools
from ...index import _host_tensor, cached_on_version, checked_cu_seqlens_host
from ...kda_tuning import recurrence_block_v, sm_count
from .. import device_rejection
from ..compile_cache import LaunchDeclined

if TYPE_CHECKING:
    from ...lightning_args import LightningPrefillArgs

__all__ = [
    "SEG_LEN_CHOICES",
    "SegmentTable",
    "choose_direct_block_v",
    "choose_seg_len",
    "direct_table",
    "uses_direct_form",
    "DIRECT_LOAD_RATIO",
    "HALF_V_LOAD_RATIO",
    "lightning_prefill_cutedsl_backend",
    "num_segments",
    "plan_lightning_prefill",
    "pool_layout_rejection",
    "segment_table",
    "verify_lightning_prefill",
]

CHUNK = 64
_ROW_ALIGN = 16  # bytes: the token tensors' promise to kernels A and C (16-byte row segments)
HEAD_DIM = 128
# seg_len candidates, longest first: the longest whose grid fills one wave of CTAs on the GPU's SMs (fewest state
# passes: each costs NSEG · H · 64 KB against the inputs' T · H · 1 KB), else the shortest (choose_seg_len)
SEG_LEN_CHOICES = (4096, 2048, 1024, 512, 256, 128, 64)
WAVE_FILL = 0.9  # CTAs per SM that count as one wave: 128 CTAs on 132 SMs do
# The direct form beyond one segment per sequence (uses_direct_form): its longest sequence at most this many times the
# tokens per SM. On a lent H100 its time on long sequences was about 0.64 x this load ratio x the segments form's
# (0.66 at 1.03, 1.28-1.31 at 2.06; benchmarks/results/lightning_prefill_forms_ab_h100.md): even near 1.56; 1.25
# keeps a margin for the H200's bandwidth, which speeds the segments form's state passes more.
DIRECT_LOAD_RATIO = 1.25
# The direct form in half-V CTAs (kernel C's V block 64: two 4-warp CTAs per sequence and head, each alone on an SM:
# choose_direct_block_v): the longest sequence may be this many times the tokens per SM. On a lent H100 the form took
# 0.87-0.93x the three launches' time at B1 H64 (ratio 2.06), 0.95x at 2.36, 0.98x at 2.75 and 3.30, 1.31x on a
# packed [12288, 4096] H32 (3.09; benchmarks/results/lightning_prefill_forms_ab_h100.md, thirty-second session):
# 2.4 keeps the wins of 5% and more, with the H200's margin as for DIRECT_LOAD_RATIO.
HALF_V_LOAD_RATIO = 2.4
DIRECT_BLOCK_V = 128  # kernel C's value columns per CTA (chunk_output.BLOCK_V)
HALF_BLOCK_V = 64  # the direct form's half-V CTAs (chunk_output.HALF_BLOCK_V)
MAX_SEG_LEN = 1 << 24  # a segment's length fits the kernels' int32 arithmetic with room to spare
_POOL_DTYPES = (torch.float32, torch.bfloat16)


# ---- the segment table (pure Python) -------------------------------------------------------------------------------


class SegmentTable(NamedTuple):
    """A batch's segments, on the host.

    Attributes:
        segments: the rows ``(n, start, length, last)`` flattened (4 ints per segment), in sequence order; ``last``
            is 1 on a sequence's last segment, else 0.
        seq_segments: ``N + 1`` offsets: sequence n's segments are rows ``seq_segments[n] .. seq_segments[n+1]-1``.
    """

    segments: list[int]
    seq_segments: list[int]

    @property
    def num_segments(self) -> int:
        return len(self.segments) // 4

    def rows(self) -> list[tuple[int, int, int, int]]:
        """The rows as tuples (for tests and messages)."""
        s = self.segments
        return [tuple(s[i:i + 4]) for i in range(0, len(s), 4)]


def _check_seg_len(seg_len: object) -> int:
    if isinstance(seg_len, bool) or not isinstance(seg_len, int):
        raise TypeError(f"seg_len must be an int (a positive multiple of {CHUNK}), got {type(seg_len).__name__}")
    if seg_len <= 0 or seg_len % CHUNK or seg_len > MAX_SEG_LEN:
        raise ValueError(f"seg_len must be a positive multiple of {CHUNK} up to {MAX_SEG_LEN}, got {seg_len}")
    return seg_len


def _check_lens(lens: Sequence[int]) -> list[int]:
    out = []
    for n, length in enumerate(lens):
        if isinstance(length, bool) or not isinstance(length, int):
            raise TypeError(f"lens[{n}] must be an int, got {type(length).__name__}")
        if length < 0:
            raise ValueError(f"lens[{n}] must be >= 0, got {length}")
        out.append(length)
    return out


def segment_table(lens: Sequence[int], seg_len: int) -> SegmentTable:
    """The segments of sequences of ``lens`` tokens laid end to end in one token axis (fixed length: ``[T] * B``,
    sequence b starting at row ``b·T``; varlen: the lengths of ``cu_seqlens``, sequence n at ``cu_seqlens[n]``).

    Each sequence is cut at multiples of ``seg_len`` from its first token: segments of ``seg_len`` tokens, the last
    one ``1 .. seg_len`` tokens, marked ``last = 1``; a sequence of no tokens has no segment. Example: ``lens = [130, 0,
    64]``, ``seg_len = 64`` gives rows ``(0, 0, 64, 0), (0, 64, 64, 0), (0, 128, 2, 1), (2, 130, 64, 1)`` and
    ``seq_segments = [0, 3, 3, 4]``.

    Raises:
        TypeError, ValueError: ``seg_len`` not a positive multiple of 64, or a length not a non-negative int.
    """
    seg_len = _check_seg_len(seg_len)
    rows: list[int] = []
    offsets = [0]
    start = 0
    for n, length in enumerate(_check_lens(lens)):
        for offset in range(0, length, seg_len):
            rows += (n, start + offset, min(seg_len, length - offset), int(offset + seg_len >= length))
        offsets.append(len(rows) // 4)
        start += length
    return SegmentTable(rows, offsets)


def direct_table(lens: Sequence[int]) -> list[int]:
    """The direct form's rows, flattened: one ``(n, first row, length, 0)`` per sequence of ``lens`` tokens laid end
    to end, empty ones too (their final state is still written). Example: ``lens = [130, 0, 64]`` gives ``(0, 0,
    130, 0), (1, 130, 0, 0), (2, 130, 64, 0)``."""
    rows: list[int] = []
    start = 0
    for n, length in enumerate(_check_lens(lens)):
        rows += (n, start, length, 0)
        start += length
    return rows


def uses_direct_form(lens: Sequence[int], seg_len: int, num_heads: int, num_sms: int,
                     direct: bool | None = None) -> bool:
    """Whether a call with sequences of ``lens`` tokens, ``num_heads`` heads and the chosen ``seg_len`` runs the
    direct form on a GPU of ``num_sms`` SMs; ``direct`` True or False forces it (tests). Never without tokens
    (nothing for kernel C to read). By default (``direct`` None), when either

    * every sequence fits in one segment (the three launches would make the same segments, and kernels A and B
      would only copy states), or
    * the direct form's CTAs keep the SMs busy: its longest sequence is at most :data:`DIRECT_LOAD_RATIO` times the
      tokens per SM, ``H · sum(lens) / num_sms`` (the time of one CTA walking the longest sequence against the
      segments form's time for all the tokens spread over the SMs), or :data:`HALF_V_LOAD_RATIO` times where it runs
      in half-V CTAs (:func:`choose_direct_block_v`: twice the CTAs, each with half the work).

    Examples, 132 SMs: B2 H64 T16384 -> direct (16384 <= 1.25 · 15887); B1 H64 T32768 -> direct in half-V CTAs
    (128 CTAs; 32768 <= 2.4 · 15887); B1 H32 T4096 -> the segments (4096 > 2.4 · 993); 10 packed sequences of
    <= 4147 tokens in 16384, H64 -> direct."""
    lens = _check_lens(lens)
    tokens = sum(lens)
    if tokens == 0:
        return False
    if direct is not None:
        return bool(direct)
    longest = max(lens)
    ratio = HALF_V_LOAD_RATIO if choose_direct_block_v(lens, num_heads, num_sms) == HALF_BLOCK_V else DIRECT_LOAD_RATIO
    return longest <= seg_len or longest * num_sms <= ratio * num_heads * tokens


def choose_direct_block_v(lens: Sequence[int], num_heads: int, num_sms: int) -> int:
    """Kernel C's value columns per CTA in the direct form: :data:`HALF_BLOCK_V` (two 4-warp CTAs per sequence and
    head, the same bits) where those CTAs still get an SM each (``2 · H ·`` the sequences with tokens ``<= num_sms``:
    an SM would otherwise idle), else :data:`DIRECT_BLOCK_V` (over full grids the 8-warp CTA is faster: fewer
    MMAs, ``benchmarks/results/lightning_block_v_ab_h100.md``). Examples, 132 SMs: B1 H64 -> 64; B2 H64 -> 128;
    B1 H16 -> 64 (32 CTAs; the direct form itself is then rarely chosen)."""
    busy = sum(1 for length in _check_lens(lens) if length)
    return HALF_BLOCK_V if 2 * num_heads * busy <= num_sms else DIRECT_BLOCK_V


def num_segments(lens: Sequence[int], seg_len: int) -> int:
    """How many segments :func:`segment_table` makes (without building it)."""
    return sum(-(-length // seg_len) for length in lens)


def choose_seg_len(lens: Sequence[int], num_heads: int, num_sms: int, *, fill: float = WAVE_FILL) -> int:
    """The segment length for sequences of ``lens`` tokens and ``num_heads`` heads on a GPU of ``num_sms`` SMs.

    The longest of :data:`SEG_LEN_CHOICES` whose ``NSEG · H`` (the segment-parallel grids' CTAs) is at least
    ``fill · num_sms`` (one wave, a few SMs aside), else 64 (all the parallelism there is). Longer segments mean
    fewer state bytes (4 passes of ``NSEG · H · 64 KB`` against the inputs' ``T · H · 1 KB``), shorter scans and
    fewer CTAs for kernel C's chunk loop to start; a second wave of shorter segments cost more than it gained on
    every shape timed (``benchmarks/results/lightning_seg_len_ab_h100.md``: this rule 0.77-0.99x the time of the
    earlier two-wave rule on the 13 bench shapes where they differ).

    Examples, 132 SMs: B1 H16 T32768 -> 4096 (128 CTAs); B1 H64 T4096 -> 2048 (128); B2 H64 T32768 -> 4096 (1024);
    B1 H16 T4096 -> 512 (128); B1 H16 T100 -> 64 (32: no length fills a wave).
    """
    lens = _check_lens(lens)
    target = fill * num_sms
    return next((s for s in SEG_LEN_CHOICES if num_segments(lens, s) * num_heads >= target), SEG_LEN_CHOICES[-1])


# ---- the device table, cached ----------------------------------------------------------------------------------------

_FIXED_CAPACITY = 64
_fixed_tables: OrderedDict[tuple, tuple] = OrderedDict()


class DeviceSegments(NamedTuple):
    """One call's segment table on the device: ``seg_len``; ``segments`` int32 ``[NSEG, 4]``; ``seq_segments`` int32
    ``[N + 1]`` (None in the direct form); ``direct``: the direct form (``segments`` one row per sequence);
    ``block_v``: kernel C's value columns per CTA (64 only in the direct form: :func:`choose_direct_block_v`)."""

    seg_len: int
    segments: torch.Tensor
    seq_segments: torch.Tensor | None
    direct: bool
    block_v: int = DIRECT_BLOCK_V


def _to_device(lens: list[int], seg_len: int, H: int, num_sms: int, direct: bool | None, block_v: int,
               device: torch.device) -> DeviceSegments:
    """The table of ``lens`` on ``device`` (the form and V block decided here, ``direct`` and ``block_v`` as
    :func:`device_segments`'): views of one int32 buffer, one copy."""
    direct = uses_direct_form(lens, seg_len, H, num_sms, direct)
    block_v = (block_v or choose_direct_block_v(lens, H, num_sms)) if direct else DIRECT_BLOCK_V
    if direct:
        rows, offsets = direct_table(lens), []
    else:
        table = segment_table(lens, seg_len)
        rows, offsets = table.segments, table.seq_segments
    buffer = _host_tensor(rows + offsets, torch.int32).to(device, non_blocking=True)
    nseg = len(rows) // 4
    seq_segments = None if direct else buffer.narrow(0, 4 * nseg, len(offsets))
    return DeviceSegments(seg_len, buffer.narrow(0, 0, 4 * nseg).view(nseg, 4), seq_segments, direct, block_v)


def _resolved_seg_len(lens: list[int], H: int, num_sms: int, seg_len: int) -> int:
    return choose_seg_len(lens, H, num_sms) if seg_len == 0 else _check_seg_len(seg_len)


def _requested_seg_len(seg_len: int) -> int:
    """``seg_len`` checked (a positive multiple of 64), or 0 (chosen per call) as given."""
    return _check_seg_len(seg_len) if seg_len else 0


def _requested_block_v(block_v: int) -> int:
    """The direct form's V block as forced (64 or 128), or 0 (chosen per call)."""
    if block_v not in (0, HALF_BLOCK_V, DIRECT_BLOCK_V):
        raise ValueError(f"direct_block_v must be 0 (the per-call choice), {HALF_BLOCK_V} or {DIRECT_BLOCK_V}, "
                         f"got {block_v!r}")
    return block_v


def device_segments(B: int, T: int, H: int, cu_seqlens: torch.Tensor | None, device: torch.device, num_sms: int,
                    seg_len: int = 0, direct: bool | None = None, block_v: int = 0) -> DeviceSegments:
    """One call's table on ``device``: ``seg_len`` as asked (0: chosen by :func:`choose_seg_len`), the form by
    :func:`uses_direct_form` (``direct``: None, or forced), the direct form's V block by
    :func:`choose_direct_block_v` (``block_v``: 0, or forced), built on the host and copied once. Cached: per
    ``(cu_seqlens, its version, H, SMs, seg_len, direct, block_v)`` in :func:`cula_runtime.index.cached_on_version`
    (the boundaries from the validator's checked host copy: no synchronisation on a hit), per ``(B, T, H, SMs,
    seg_len, direct, block_v, device)`` without ``cu_seqlens``."""
    if cu_seqlens is None:
        key = (B, T, H, num_sms, seg_len, direct, block_v, device)
        hit = _fixed_tables.get(key)
        if hit is not None:
            _fixed_tables.move_to_end(key)
            return hit
        lens = [T] * B
        chosen = _resolved_seg_len(lens, H, num_sms, seg_len)
        # (kept between calls: never in a CUDA graph's pool)
        value = built_outside_graph_pools(device, lambda: _to_device(lens, chosen, H, num_sms, direct, block_v,
                                                                     device))
        _fixed_tables[key] = value
        while len(_fixed_tables) > _FIXED_CAPACITY:
            _fixed_tables.popitem(last=False)
        return value

    def build() -> DeviceSegments:
        values = checked_cu_seqlens_host(cu_seqlens, T).tolist()
        lens = [b - a for a, b in zip(values, values[1:], strict=False)]
        chosen = _resolved_seg_len(lens, H, num_sms, seg_len)
        return _to_device(lens, chosen, H, num_sms, direct, block_v, device)

    return cached_on_version("lightning_segments", cu_seqlens, (T, H, num_sms, seg_len, direct, block_v), build)


def clear_segment_cache() -> None:
    """Forget the fixed-length tables (the varlen ones live in :mod:`cula_runtime.index`'s cache)."""
    _fixed_tables.clear()


# ---- verify ---------------------------------------------------------------------------------------------------------


def pool_layout_rejection(pool: torch.Tensor) -> str | None:
    """Why kernel B cannot read and write this pool in place, or None: each slot's heads compact ``[128, 128]``
    blocks (the kernel's static row strides), the slot and head strides multiples of 4 elements and the data aligned
    to 4 elements (16 bytes fp32, 8 bytes bf16: its vectors). A pool is never copied."""
    strides = pool.stride()
    if tuple(strides[2:]) != (HEAD_DIM, 1) or (pool.shape[1] > 1 and strides[1] % 4):
        return f"needs each pool slot's heads compact [{HEAD_DIM}, {HEAD_DIM}] blocks, got strides {list(strides)}"
    if (pool.shape[0] > 1 and strides[0] % 4) or pool.data_ptr() % (4 * pool.element_size()):
        return (f"needs the pool's slot stride a multiple of 4 elements and its data {4 * pool.element_size()}-byte "
                f"aligned, got stride {strides[0]} at address {pool.data_ptr():#x}")
    return None


def verify_lightning_prefill(args: LightningPrefillArgs) -> tuple[bool, str]:
    """Whether the CuTeDSL kernels serve these validated ``lightning_prefill`` arguments, and if not, why. Free of
    side effects; imports no CuTeDSL."""
    reason = device_rejection(args.device)
    if reason is not None:
        return False, reason
    if args.q.dtype != torch.bfloat16:
        return False, f"needs bf16 q/k/v, got {args.q.dtype}"
    if (args.K, args.V) != (HEAD_DIM, HEAD_DIM):
        return False, f"needs K = V = {HEAD_DIM}, got K={args.K} V={args.V}"
    if args.H > 65535:
        return False, f"needs H <= 65535 (a grid dimension), got H={args.H}"
    if args.initial_state is not None and args.initial_state.dtype != torch.float32:
        return False, f"needs an fp32 initial_state, got {args.initial_state.dtype}"
    if args.state is not None:
        if args.state.dtype not in _POOL_DTYPES:
            return False, f"needs an fp32 or bf16 state pool, got {args.state.dtype}"
        reason = pool_layout_rejection(args.state)
        if reason is not None:
            return False, reason
    return True, "CuTeDSL kernels serve this call (segment states, scan, output)"


# ---- the backend ----------------------------------------------------------------------------------------------------


@functools.cache
def _states() -> object:
    """:mod:`.chunk_states` (kernels A and B), imported on the first call (importing it imports CuTeDSL)."""
    from . import chunk_states

    return chunk_states


@functools.cache
def _kernel_c() -> object:
    """:mod:`.chunk_output` (kernel C, both forms), imported on the first call that has tokens."""
    from . import chunk_output

    return chunk_output


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` -> the flattened token axis ``[B·T, H, D]`` (a view of a contiguous tensor)."""
    return x.view(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])


def lightning_prefill_cutedsl_backend(args: LightningPrefillArgs, *, seg_len: int = 0, block_v: int = 0,
                                      direct: bool | None = None,
                                      direct_block_v: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run validated ``lightning_prefill`` arguments (accepted by :func:`verify_lightning_prefill`) on the CuTeDSL
    kernels: ``(o, final_state)``.

    Args:
        args: validated arguments.
        seg_len: the segment length (a positive multiple of 64); 0: :func:`choose_seg_len` per call.
        block_v: kernel A's value columns per CTA, 64 or 128 (the same bits); 0: chosen from NSEG · H and the SMs.
        direct: the direct form forced (True) or not (False); None: :func:`uses_direct_form` decides (tests force
            both forms on the same inputs).
        direct_block_v: kernel C's value columns per CTA in the direct form, 64 or 128 (the same bits); 0:
            :func:`choose_direct_block_v`.

    Returns:
        ``o`` ``[B, T, H, V]`` in q's dtype, and the fp32 final state in the layout of ``state_v_first`` when
        ``output_final_state`` (else None); with a pool (``args.state``): ``(o, None)``, the pool updated in place
        (each sequence's final state in its slot; a slot outside ``[0, P)`` is padding: not read, not written, its
        outputs zeros). Launched on the current stream; the intermediate ``seg_state``
        (``NSEG · H · 64 KB``) lives until the call returns.
    """
    states = _states()
    if block_v not in (0, 64, 128):
        raise ValueError(f"block_v must be 0 (the per-call choice), 64 or 128, got {block_v!r}")
    device = args.device
    B, T, H, K, V = args.B, args.T, args.H, args.K, args.V
    o = torch.empty(B, T, H, V, dtype=args.q.dtype, device=device)
    pool = args.state
    ht = torch.empty(args.state_shape, dtype=torch.float32, device=device) \
        if args.output_final_state and pool is None else None
    if args.N == 0:
        return o, ht
    num_sms = sm_count(device)
    _, segments, seq_segments, use_direct, c_block_v = device_segments(
        B, T, H, args.cu_seqlens, device, num_sms, _requested_seg_len(seg_len), direct,
        _requested_block_v(direct_block_v))
    q, k, v, o_flat = _flat(args.q), _flat(args.k), _flat(args.v), _flat(o)
    if use_direct:
        _kernel_c().direct_output_run(q, k, v, args.g_gamma, segments, o_flat, args.scale, args.initial_state, ht,
                                      args.state_v_first, pool, args.state_indices, args.has_initial_state, c_block_v)
        return o, ht
    nseg = segments.shape[0]
    seg_state = torch.empty(nseg, H, K, V, dtype=torch.float32, device=device)
    if nseg:
        states._states_run(k, v, args.g_gamma, segments, seg_state, block_v or recurrence_block_v(nseg * H, num_sms),
                           skip_last=True)
    states._scan_run(seg_state, segments, seq_segments, args.g_gamma, args.initial_state, ht, args.state_v_first,
                     pool, args.state_indices, args.has_initial_state, skip_last=True)
    if nseg:
        _kernel_c().segments_output_run(q, k, v, args.g_gamma, seg_state, segments, o_flat, args.scale, ht,
                                        args.state_v_first, pool, args.state_indices)
    return o, ht


def plan_lightning_prefill(args: LightningPrefillArgs, *, seg_len: int = 0,
                           direct: bool | None = None) -> Callable | None:
    """A call plan (``cula.call_plans``) for every later call with the signature of ``args`` (validated arguments
    :func:`verify_lightning_prefill` accepted): ``plan(q, k, v, g_gamma, initial_state, cu_seqlens, state,
    state_indices, has_initial_state) -> (o, final)`` runs the three kernels (or the direct form's one) with nothing
    validated or dispatched, through launches bound once (``compile_cache.bound_launch``), the segment table from its
    cache (fixed length: built here, once; varlen: per ``cu_seqlens`` tensor and version, from the cached checked
    host copy of its values). ``seg_len``: as :func:`lightning_prefill_cutedsl_backend`'s, fixed for every call of the
    plan. ``direct``: as the backend's (the form is decided per call from the table: a varlen plan may run either).
    Holds no tensor of the call it was made from.

    A launch TVM-FFI refuses raises ``LaunchDeclined`` before it launches (the caller then runs the call unplanned).
    Kernel B writes only ``seg_state`` and the final states of sequences without tokens (which a rerun writes again
    alike); kernel C writes the others', so q, which only kernel C reads, has its alignment checked before kernel A
    (k and v are kernel A's too, refused there; o is the plan's own; the pool and ht kernel B's too)."""
    states = _states()
    device = args.device
    B, T, H, K, V, N = args.B, args.T, args.H, args.K, args.V, args.N
    dtype, scale, v_first = args.q.dtype, args.scale, args.state_v_first
    state_shape = args.state_shape
    want_ht = args.output_final_state and args.state is None
    num_sms = sm_count(device)
    fixed_seg_len = _requested_seg_len(seg_len)
    flags = states.scan_flags(args.initial_state, want_ht, v_first, args.state, args.has_initial_state)
    runs_a: dict[int, Callable] = {}
    run_b: list[Callable] = []  # kernel B, bound on the first call that cuts segments (or has no tokens)
    run_c: list[Callable] = []  # kernel C, bound on the first call with tokens
    runs_direct: dict[int, Callable] = {}  # the direct form per V block, bound on the first call that runs it

    def plan(q, k, v, g_gamma, initial_state, cu_seqlens, state, state_indices, has_initial_state):
        if q.data_ptr() % _ROW_ALIGN:  # (kernel C's promise on q, checked before kernel B can write anything)
            raise LaunchDeclined
        o = torch.empty(B, T, H, V, dtype=dtype, device=device)
        ht = torch.empty(state_shape, dtype=torch.float32, device=device) if want_ht else None
        if N == 0:
            return o, ht
        _, segments, seq_segments, use_direct, c_block_v = device_segments(B, T, H, cu_seqlens, device, num_sms,
                                                                           fixed_seg_len, direct)
        kf, o_flat = _flat(k), _flat(o)
        if use_direct:
            run_direct = runs_direct.get(c_block_v)
            if run_direct is None:
                run_direct = runs_direct[c_block_v] = _kernel_c().plan_direct_output(H, flags, device, c_block_v)
            run_direct(_flat(q), kf, _flat(v), g_gamma, segments, o_flat, scale, initial_state, ht, state,
                       state_indices, has_initial_state)
            return o, ht
        nseg = segments.shape[0]
        seg_state = torch.empty(nseg, H, K, V, dtype=torch.float32, device=device)
        if nseg:
            bv = recurrence_block_v(nseg * H, num_sms)
            run_a = runs_a.get(bv)
            if run_a is None:
                run_a = runs_a[bv] = states.plan_segment_states(H, dtype, bv, device)
            run_a(kf, _flat(v), g_gamma, segments, seg_state)
        if not run_b:
            run_b.append(states.plan_segment_scan(H, N, flags, device))
        run_b[0](seg_state, segments, seq_segments, g_gamma, initial_state, ht, state, state_indices,
                 has_initial_state)
        if nseg:
            if not run_c:
                run_c.append(_kernel_c().plan_chunk_output(H, device, flags))
            run_c[0](_flat(q), kf, _flat(v), g_gamma, seg_state, segments, o_flat, scale, ht, state, state_indices)
        return o, ht

    return plan
