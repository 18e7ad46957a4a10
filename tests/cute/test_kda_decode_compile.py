"""CuTeDSL compilation of the KDA decode kernel (KdaDecode) on the CPU, for sm_90a, sm_100a and sm_103a, and a
pure-Python emulation of its lane → (K row, V column) mapping.

The machine code moves the state with 16-byte global loads and stores only (8 per lane, one pass each way, no MMA of
any kind). V-first reduces over K with warp shuffles only (no shared memory, no barrier); K-first reduces over the
warp's rows with shuffles, then over the 4 warps through one shared-memory exchange and one barrier per token. Its
local-memory spills are the ones measured with the installed CuTeDSL.

Five configurations cover the kernel's code paths: a T = 1 fp32 pool in the K-first layout (the serving case);
packed sequences with per-token slots and accepted counts, the V-first fp32 layout, the L2 norm and the lower-bound
gate from bf16 g and β logits; a bf16 pool in the V-first layout with the softplus gate; per-token slots in a K-first
fp32 pool with the L2 norm and the lower-bound gate; packed sequences with per-token slots and accepted counts in a
K-first bf16 pool with the L2 norm and the softplus gate from bf16 g and β logits. Two more compile the serving
case with K-first CTAs of whole rows, fp32 (4 lines per K row) and bf16 (2): ``k_first_lines``, the configuration
of steps reading at least 128 MiB of state; each line group exchanges among its own 4 warps behind its own named
barrier. The emulation runs every line count.

The emulation checks, from the kernel's own index methods, that every element of a head is held by exactly one lane
of one CTA, that each warp-wide state access covers whole 128-byte lines, that the lanes a reduction combines hold
one column's 128 K rows once each, that the K-first exchange's writes and reads meet, and that o is written once per
column.

Needs CuTeDSL and TVM-FFI (cula-runtime brings them on Linux x86_64/aarch64); skips cleanly without them.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.cute.compile_helpers import (
    COMPILE_MARKS,
    assert_exchange_barriers,
    assert_measured_spills,
    assert_simt_only,
    compile_machine_code,
    compile_params,
)

pytestmark = COMPILE_MARKS

# KdaDecodeConfig fields (the gate as InKernelGate fields) of the compiled configurations
CONFIGS = {
    "T1-fp32-kv-H4-HV8": dict(num_heads=4, num_v_heads=8),
    # K-first CTAs of whole rows (k_first_lines: the configurations of steps reading >= 128 MiB of state)
    "T1-fp32-kv-H4-HV8-4lines": dict(num_heads=4, num_v_heads=8, k_first_lines=4),
    "T1-bf16-kv-H4-HV8-2lines": dict(num_heads=4, num_v_heads=8, state_dtype="bfloat16", k_first_lines=2),
    "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8": dict(
        num_heads=2, num_v_heads=8, varlen=True, per_token_slots=True, num_accepted=True, l2norm=True,
        state_v_first=True,
        gate=dict(form="safe", g_dtype="bfloat16", beta_dtype="bfloat16", has_A_log=True, has_dt_bias=True,
                  beta_sigmoid=True, allow_neg_eigval=True)),
    "bf16-vk-softplus-H8-HV8": dict(
        num_heads=8, num_v_heads=8, state_dtype="bfloat16", state_v_first=True,
        gate=dict(form="softplus", has_A_log=True, has_dt_bias=True, beta_sigmoid=True)),
    "slots-fp32-kv-l2-safe-H4-HV4": dict(
        num_heads=4, num_v_heads=4, per_token_slots=True, l2norm=True,
        gate=dict(form="safe", has_A_log=True, has_dt_bias=True, beta_sigmoid=True)),
    "varlen-slots-accepted-bf16-kv-l2-softplus-bf16gb-H2-HV8": dict(
        num_heads=2, num_v_heads=8, state_dtype="bfloat16", varlen=True, per_token_slots=True, num_accepted=True,
        l2norm=True,
        gate=dict(form="softplus", g_dtype="bfloat16", beta_dtype="bfloat16", has_A_log=True, has_dt_bias=True,
                  beta_sigmoid=True)),
}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8"
# Local-memory spill instructions (LDL + STL) per CuTeDSL minor version, configuration and target, as measured. The
# fp32 pool runs at 96 registers (5 CTAs per SM; decode.MIN_BLOCKS_PER_SM, MIN_BLOCKS_PER_SM_K_FIRST), where ptxas
# spills a few values on SM90 (K-first T = 1: two 8-byte pointers saved before the state's loads, one reloaded for
# its stores, and a few loop invariants of the token loop; with the lower-bound gate, dt_bias in the token loop).
# A bf16 K-first pool at 128 registers spills about as many at 2 lines as at 1 (10 at 1 line on SM90, 14-24 on
# SM100/SM103); whole fp32 rows at 128 registers (1 CTA of 512 threads) none.
SPILLS = {
    "4.6": {
        "T1-fp32-kv-H4-HV8": {"sm_90a": 10, "sm_100a": 0, "sm_103a": 0},
        "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8": {"sm_90a": 43, "sm_100a": 0, "sm_103a": 0},
        "bf16-vk-softplus-H8-HV8": {"sm_90a": 8, "sm_100a": 16, "sm_103a": 16},
        "slots-fp32-kv-l2-safe-H4-HV4": {"sm_90a": 25, "sm_100a": 16, "sm_103a": 16},
        "varlen-slots-accepted-bf16-kv-l2-softplus-bf16gb-H2-HV8": {"sm_90a": 0, "sm_100a": 2, "sm_103a": 0},
        "T1-fp32-kv-H4-HV8-4lines": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-bf16-kv-H4-HV8-2lines": {"sm_90a": 10, "sm_100a": 33, "sm_103a": 33},
    },
    "4.8": {
        "T1-fp32-kv-H4-HV8": {"sm_90a": 12, "sm_100a": 0, "sm_103a": 0},
        "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8": {"sm_90a": 27, "sm_100a": 0, "sm_103a": 0},
        "bf16-vk-softplus-H8-HV8": {"sm_90a": 8, "sm_100a": 12, "sm_103a": 10},
        "slots-fp32-kv-l2-safe-H4-HV4": {"sm_90a": 25, "sm_100a": 0, "sm_103a": 0},
        "varlen-slots-accepted-bf16-kv-l2-softplus-bf16gb-H2-HV8": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-fp32-kv-H4-HV8-4lines": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-bf16-kv-H4-HV8-2lines": {"sm_90a": 13, "sm_100a": 12, "sm_103a": 12},
    },
}


def _config(config_id: str):
    from cula_runtime.cute.kda.decode import KdaDecodeConfig
    from cula_runtime.cute.kda.intra import InKernelGate

    fields = dict(CONFIGS[config_id])
    if "gate" in fields:
        fields["gate"] = InKernelGate(**fields["gate"])
    return KdaDecodeConfig(**fields)


@pytest.mark.parametrize(("config_id", "target"), compile_params(CONFIGS, DSL_FLOOR))
def test_kda_decode_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.kda.decode import KdaDecode

    config = _config(config_id)
    kernel = KdaDecode(config)
    code = compile_machine_code(KdaDecode, config, target)

    # SIMT only: no MMA of any flavour
    assert_simt_only(code)
    # The token step is in the code twice: the peeled first token and the token loop.
    steps = 2
    VC = kernel.cols
    k_first = not config.state_v_first
    if k_first:
        # the warps' exchange: per token step, row group 0 of each warp writes its kᵀS and qᵀS (2 · VC / 4 16-byte
        # pieces) and lane 0 its q·k; one barrier; every thread reads its columns' kᵀS of the 4 warps, warp 0 also
        # their qᵀS and q·k (one 16-byte read)
        pieces = VC // 4
        assert code.opcodes["STS.128"] == steps * 2 * pieces
        assert code.opcodes["STS"] == steps
        assert code.opcodes["LDS.128"] == steps * (2 * 4 * pieces + 1)  # (a line group's 4 warps)
        assert code.count("BAR") == steps and code.opcodes["BAR.SYNC.DEFER_BLOCKING"] == steps
        assert_exchange_barriers(code, config.k_first_lines)
        assert not [op for op in code.opcodes if op.startswith(("LDS", "STS")) and op not in ("LDS.128", "STS.128",
                                                                                              "STS")]
    else:  # the reductions over K stay in a warp: no shared memory, no barrier
        for prefix in ("LDS", "STS", "BAR"):
            assert code.count(prefix) == 0, prefix
    # 16-byte global loads: the state's 8 vectors per lane, once; per token step q and k (K-first: one vector each
    # of the lane's 8 contiguous rows), g (fp32: two vectors; bf16: one in K-first, 8-byte pieces in V-first) and v
    # (a bf16 pool's 8 columns per lane); dt_bias's two vectors, once.
    g_fp32 = config.gate.g_dtype == "float32"
    per_step = (2 if k_first else 0) + (2 if g_fp32 else (1 if k_first else 0)) + (1 if VC == 8 else 0)
    assert code.opcodes["LDG.E.128"] == 8 + steps * per_step + (2 if config.gate.has_dt_bias else 0)
    # The state: 8 16-byte vectors per lane, stored once per call (T = 1, [N] indices), or after every token with
    # [N, W] indices (the peeled first token and the token loop each store them).
    state_stores = 16 if config.per_token_slots else 8
    # o: one 8-byte (fp32 pool: 4 columns per lane) or 16-byte (bf16 pool: 8) store per token, in the padding
    # row's zero loop and the two copies of the token step
    o_store = "STG.E.64" if VC == 4 else "STG.E.128"
    assert code.opcodes["STG.E.128"] == state_stores + (3 if o_store == "STG.E.128" else 0)
    assert code.opcodes[o_store] == 3 + (state_stores if o_store == "STG.E.128" else 0)
    assert not any(op.startswith("STG") and op not in ("STG.E.128", "STG.E.64") for op in code.opcodes), \
        "every store is a vector (state 16 bytes, o 8 or 16 bytes)"
    # shfl.bfly all-reduces, per token step. V-first: 4 steps over the 16 lanes of a column group for q·k, kᵀS and
    # qᵀS of the lane's columns (and Σq², Σk² with the L2 norm). K-first: 2 steps over the warp's 4 row groups for
    # the same 2 · VC + 1 values, and with the L2 norm 5 steps over the whole warp for Σq², Σk².
    values = 1 + 2 * VC
    if k_first:
        shuffles = 2 * values + (5 * 2 if config.l2norm else 0)
    else:
        shuffles = 4 * (values + (2 if config.l2norm else 0))
    assert code.opcodes["SHFL.BFLY"] == steps * shuffles
    assert code.count("MUFU.EX2") >= 8  # the decay of the lane's 8 K rows
    assert_measured_spills(code, SPILLS, config_id, target)


# ---------------------------------------------------------------------------------------------------------------
# The lane mapping, emulated on the CPU from the kernel's index methods (nothing compiles)

# (pool dtype, V-first, K-first CTAs' lines per K row: 0 = the default; every count a K-first row allows)
LAYOUTS = [pytest.param(dtype, v_first, lines, id=f"{dtype}-{'vk' if v_first else 'kv'}" + (f"-{lines}l" * bool(lines)))
           for dtype in ("float32", "bfloat16") for v_first in (False, True)
           for lines in ((0,) if v_first else (0, 1, 2, 4) if dtype == "float32" else (0, 1, 2))]
K = 128


def _kernel(state_dtype: str, v_first: bool, lines: int = 0):
    from cula_runtime.cute.kda.decode import KdaDecode, KdaDecodeConfig

    return KdaDecode(KdaDecodeConfig(num_heads=1, num_v_heads=1, state_dtype=state_dtype, state_v_first=v_first,
                                     k_first_lines=lines))


def _lane_elements(kernel, vb: int, warp: int, lane: int) -> list[list[tuple[int, int]]]:
    """(K row, V column) of each element of the lane's 8 state vectors, as the kernel assigns them."""
    _, col0, bases = kernel.lane_layout(warp, lane, vb)
    vectors = []
    for p in range(8):
        elements = []
        for e in range(kernel.vec):
            i, j = kernel.element(e, p)
            elements.append((kernel.row(i, bases), col0 + j))
        vectors.append(elements)
    return vectors


@pytest.mark.parametrize(("state_dtype", "v_first", "lines"), LAYOUTS)
def test_each_element_once_in_whole_lines(state_dtype: str, v_first: bool, lines: int) -> None:
    """Every element of a head is held by exactly one lane of one of its CTAs; each lane's vector is 16 contiguous,
    aligned bytes; every warp-wide access (vector p of the 32 lanes) covers whole 128-byte lines."""
    kernel = _kernel(state_dtype, v_first, lines)
    elem_bytes = 16 // kernel.vec
    assert kernel.block_v * kernel.v_blocks == K
    if not v_first:
        assert kernel.block_v * elem_bytes == 128 * kernel.lines  # a CTA's part of a K-first row: its lines
        assert kernel.num_warps == 4 * kernel.lines
    holders: dict[tuple[int, int], int] = {}
    for vb in range(kernel.v_blocks):
        for warp in range(kernel.num_warps):
            per_access: list[set[int]] = [set() for _ in range(8)]
            for lane in range(32):
                for p, elements in enumerate(_lane_elements(kernel, vb, warp, lane)):
                    offsets = [k * K + v if not v_first else v * K + k for k, v in elements]
                    assert offsets == list(range(offsets[0], offsets[0] + kernel.vec)), "a vector is contiguous"
                    assert offsets[0] % kernel.vec == 0, "a vector is 16-byte aligned"
                    for k, v in elements:
                        assert (k, v) not in holders, f"element {(k, v)} held twice"
                        holders[(k, v)] = vb
                        assert vb * kernel.block_v <= v < (vb + 1) * kernel.block_v
                    per_access[p].update(range(offsets[0] * elem_bytes, (offsets[0] + kernel.vec) * elem_bytes))
            for p, covered in enumerate(per_access):
                lines = {byte // 128 for byte in covered}
                assert len(covered) == 128 * len(lines), f"warp {warp} access {p} covers partial lines"
                if not v_first:
                    assert len(lines) == 4  # 4 K rows × 128 bytes per instruction
    assert len(holders) == K * K


@pytest.mark.parametrize(("state_dtype", "v_first", "lines"), LAYOUTS)
def test_reductions_cover_each_column_once(state_dtype: str, v_first: bool, lines: int) -> None:
    """The lanes one shfl.bfly all-reduce combines (``reduce_masks``) hold the same columns and disjoint rows; with
    the other warps whose sums the K-first exchange adds (the same column group in every warp), they hold all 128
    K rows of those columns once. The lane's q, k and g rows are its state rows (K-first: one 16-byte piece of 8
    contiguous rows); o is written by one lane per column."""
    kernel = _kernel(state_dtype, v_first, lines)
    for vb in range(kernel.v_blocks):
        written: list[int] = []
        by_column: dict[int, list[int]] = {}
        for warp in range(kernel.num_warps):
            for lane in range(32):
                r, col0, bases = kernel.lane_layout(warp, lane, vb)
                rows = [kernel.row(i, bases) for i in range(8)]
                elements = _lane_elements(kernel, vb, warp, lane)
                assert {k for vector in elements for k, _ in vector} == set(rows)
                assert {v for vector in elements for _, v in vector} == set(range(col0, col0 + kernel.cols))
                assert [bases[p] + e for p in range(2) for e in range(4)] == rows  # q/k/g pieces (e, p)
                if not v_first:
                    assert rows == list(range(rows[0], rows[0] + 8)) and rows[0] % 8 == 0
                group = {lane ^ (mask_set) for mask_set in _xor_span(kernel.reduce_masks)}
                partners = [kernel.lane_layout(warp, other, vb) for other in group]
                assert all(c == col0 for _, c, _ in partners), "a reduction adds lanes of other columns"
                for v in range(col0, col0 + kernel.cols):
                    by_column.setdefault(v, []).extend(rows)
                if kernel.stores_o(r, 32 * warp + lane):
                    written.extend(range(col0, col0 + kernel.cols))
                if not v_first:  # the exchange: a thread adds the sums of its column group (lane % 8) of each
                    # warp of its line group
                    first = kernel.exchange_warps(warp)
                    for other_warp in range(first, first + 4):
                        assert kernel.lane_layout(other_warp, lane % 8, vb)[1] == col0
        for v, rows in by_column.items():
            assert sorted(rows) == list(range(K)), f"column {v}: rows held {len(rows)} times, not each once"
        assert sorted(written) == list(range(vb * kernel.block_v, (vb + 1) * kernel.block_v)), "o written once"


def _xor_span(masks: tuple[int, ...]) -> set[int]:
    """Every XOR of a subset of ``masks``: the lanes a butterfly over them combines with lane 0."""
    span = {0}
    for mask in masks:
        span |= {x ^ mask for x in span}
    return span


@pytest.mark.parametrize(("state_dtype", "lines"), [("float32", 0), ("float32", 2), ("float32", 4), ("bfloat16", 0),
                                                    ("bfloat16", 2)])
def test_exchange_writes_meet_reads(state_dtype: str, lines: int) -> None:
    """K-first exchange: the writers' slots (row group 0 of each warp: lane c writes its kᵀS and qᵀS, 16-byte
    pieces m) are distinct and inside the buffer, the two token-parity buffers are disjoint, piece m of the 8 column
    groups is 128 contiguous bytes (one wavefront), and a reader (any lane l, column group l % 8) finds there the
    sums of its own columns (from each warp of its line group: :meth:`exchange_warps`)."""
    kernel = _kernel(state_dtype, False, lines)
    shape, stride = kernel.exchange_shape_stride()
    VC, NW = kernel.cols, kernel.num_warps
    assert shape == (4, VC // 4, 8, 2, NW, 2)
    size = max(sum((n - 1) * s for n, s in zip(shape, stride, strict=True)), 0) + 1

    def offset(*coord: int) -> int:
        return sum(c * s for c, s in zip(coord, stride, strict=True))

    slots: dict[int, tuple] = {}
    for buf in range(2):
        for warp in range(NW):
            for writer in range(8):  # row group 0's lanes; lane c is column group c
                _, col0, _ = kernel.lane_layout(warp, writer, 0)
                for half in range(2):
                    for m in range(VC // 4):
                        for e in range(4):
                            slot = offset(e, m, writer, half, warp, buf)
                            assert slot not in slots and 0 <= slot < size
                            slots[slot] = (buf, warp, half, col0 + 4 * m + e)
    assert len(slots) == size == 2 * NW * 2 * 8 * VC
    for buf in range(2):
        for warp in range(NW):
            for half in range(2):
                for m in range(VC // 4):
                    piece = sorted(offset(e, m, c, half, warp, buf) for c in range(8) for e in range(4))
                    assert piece == list(range(piece[0], piece[0] + 32)) and piece[0] % 32 == 0
    for lane in range(32):  # a reader of every warp finds its own columns' sums of each warp of its line group
        for reader_warp in range(NW):
            _, col0, _ = kernel.lane_layout(reader_warp, lane, 0)
            first = kernel.exchange_warps(reader_warp)
            for warp in range(first, first + 4):
                for half in range(2):
                    for j in range(VC):
                        slot = offset(j % 4, j // 4, lane % 8, half, warp, 1)
                        assert slots[slot] == (1, warp, half, col0 + j)


def test_one_binary_serves_every_batch() -> None:
    """Every extent of every tensor argument is symbolic: one compilation for any B, T, N, W, P or cu_seqlens."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.decode import KdaDecode

    config = _config("T1-fp32-kv-H4-HV8")
    for spec in KdaDecode(config).argument_specs():
        if spec is not None:
            fake = spec.fake()
            assert all(fake.dynamic_shapes_mask)
    compiled = compile_cache.compile_kernel(KdaDecode, config, target="sm_90a")
    assert compile_cache.compile_kernel(KdaDecode, config, target="sm_90a") is compiled


@pytest.mark.parametrize(("pool", "N", "HV", "v_first", "lines"), [
    ("float32", 63, 32, False, 0),  # 126 MiB of state: one line (0)
    ("float32", 64, 32, False, 4),  # 128 MiB: whole rows
    ("float32", 8, 256, False, 4),
    ("bfloat16", 127, 32, False, 0),
    ("bfloat16", 128, 32, False, 2),
    ("float32", 512, 32, True, 0),  # V-first: no lines
])
def test_whole_rows_from_128_mib_of_state(pool: str, N: int, HV: int, v_first: bool, lines: int) -> None:
    """A call's configuration takes a row's every line (4 fp32, 2 bf16) where its step reads at least
    ``WHOLE_ROWS_BYTES`` (128 MiB) of state, N · HV heads of the pool's dtype, else one (0); meta tensors: nothing
    is allocated or compiled."""
    import torch

    from cula_runtime.cute.kda import decode

    assert decode.WHOLE_ROWS_BYTES == 128 << 20
    dtype = getattr(torch, pool)
    state = torch.empty(N + 3, HV, 128, 128, dtype=dtype, device="meta")
    g = torch.empty(N, 1, HV, 128, device="meta")
    beta = torch.empty(N, 1, HV, device="meta")
    idx = torch.empty(N, dtype=torch.int32, device="meta")
    config = decode._launch_args(HV // 2, HV, g, beta, state, idx, None, None, None, None, False, False, False,
                                 False, v_first, None, None)[0]
    assert config.k_first_lines == lines
    if not v_first:  # 4 warps per line
        assert decode.KdaDecode(config).num_warps == 4 * max(lines, 1)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_dim": 64}, "only K = V = 128"),
        ({"num_v_heads": 6}, "multiple of num_heads"),
        ({"state_dtype": "float16"}, "state_dtype"),
        ({"num_accepted": True}, "per-token state indices"),
        ({"gate": {"form": "softplus", "has_A_log": False}}, "softplus gate needs A_log"),
        ({"gate": {"form": "none", "has_dt_bias": True, "has_A_log": False}}, "only used by an activated gate"),
        ({"gate": {"form": "none", "has_A_log": False, "has_dt_bias": False, "allow_neg_eigval": True,
                   "beta_sigmoid": False}}, "allow_neg_eigval"),
        ({"k_first_lines": 3}, "k_first_lines=3"),
        ({"k_first_lines": 8}, "k_first_lines=8"),
        ({"state_dtype": "bfloat16", "k_first_lines": 4}, "a row's 2 lines"),
        ({"state_v_first": True, "k_first_lines": 1}, "K-first"),
    ],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.kda.decode import KdaDecode
    from cula_runtime.cute.kda.intra import InKernelGate

    if "gate" in changes:
        changes = dict(changes, gate=InKernelGate(**changes["gate"]))
    config = dataclasses.replace(_config("T1-fp32-kv-H4-HV8"), **changes)
    ok, why = KdaDecode.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        KdaDecode(config)
