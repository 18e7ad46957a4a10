"""CuTeDSL compilation of kernel C of the Lightning prefill (LightningChunkOutput) on the CPU, for sm_90a, sm_100a
and sm_103a: the machine code holds exactly the warp-level bf16 MMAs, ldmatrix/stmatrix and cp.async traffic of one
64-token chunk in its (not unrolled) chunk loop, with the score tile's code once (one score block, in a loop every
warp runs over its own blocks), its exp2 only in the prologue (the decay tables), two CTA barriers per chunk, rows
past a segment zero-filled by the copies themselves, a chunk loop within its measured size, and its local-memory
spills are the ones measured with the installed CuTeDSL.

Needs CuTeDSL and TVM-FFI (cula-runtime brings them on Linux x86_64/aarch64); skips cleanly without them.
"""

from __future__ import annotations

import dataclasses

import pytest

from cula_runtime import cute as cula_cute
from tests.cute.dsl_versions import measured

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(
        not cula_cute.is_available(),
        reason="CuTeDSL or TVM-FFI is not installed (cula-runtime brings them on Linux x86_64/aarch64)",
    ),
]

SM = {"sm_90a": "SM90", "sm_100a": "SM100", "sm_103a": "SM103"}
C, K = 64, 128

# LightningChunkOutputConfig fields of the compiled configuration (its one V block, 128; 64 was retired in issue 28)
CONFIGS = {
    "bv128-H64": dict(num_heads=64, block_v=128),
}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = ("bv128-H64",)
# Local-memory spill instructions (LDL + STL) per CuTeDSL minor version, configuration and target, as measured: none
# (4.8.1 after issue 28's instruction cut: 222 registers on sm_90a, 216 on sm_100a/sm_103a; before it 254-255 with
# 4.6.2, 4.7.1 and 4.8.1 alike, no spills: 4.6 and 4.7 are not re-measured since).
SPILLS = {version: {config_id: dict.fromkeys(SM, 0) for config_id in CONFIGS} for version in ("4.6", "4.7", "4.8")}

# Per chunk and warp (16 value rows): q·S 8 k-blocks x 8 token tiles, vᵀ·Pᵀ 2 x (4 + 3 + 2 + 1) tiles, the state
# 4 token blocks x 16 K tiles; one 16 x 16 score block (2 n8 tiles x 8 k-blocks): the code every warp loops over
# for its blocks of the score tile's 10 (before issue 28's instruction cut each warp's blocks had their own code:
# 10 x 16 MMAs in the loop, two warps' worth issued by each warp, one of them predicated off).
SCORE_BLOCKS = 10
HMMA_PER_CHUNK = 64 + 20 + 64 + 16
# ldmatrix x4 in the chunk loop: q 8 k-blocks x 4, P 4 + 3 + 2 + 1 (upper blocks are never loaded), a score block's
# k rows 8 and its run's q rows 8 (read once per query block of a warp: 8 warps, 8 runs); transposed: kᵀ 4 token
# blocks x 8, vᵀ 4. stmatrix.trans x4: oᵀ 4.
LDSM_PER_CHUNK = 32 + 10 + 8 + 8
LDSM_T_PER_CHUNK = 32 + 4
STSM_T_PER_CHUNK = 4
# Instructions (NOP excluded) of the chunk loop, as measured with CuTeDSL 4.8.1 after issue 28's instruction cut
# (before it: sm_90a 1347, sm_100a and sm_103a 1279), with a little headroom for other CuTeDSL / ptxas versions: a
# bound, so that a change that grows the loop is seen.
CHUNK_LOOP_MAX = {"bv128-H64": {"sm_90a": 720, "sm_100a": 660, "sm_103a": 660}}


def _config(config_id: str):
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutputConfig

    return LightningChunkOutputConfig(**CONFIGS[config_id])


@pytest.mark.parametrize(("config_id", "target"), [
    pytest.param(config_id, target, id=f"{config_id}-{target}",
                 marks=[pytest.mark.dsl_floor] if config_id in DSL_FLOOR else [])
    for config_id in CONFIGS for target in SM
])
def test_lightning_output_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.compile_cache import compile_kernel, compile_seconds
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput
    from cula_runtime.cute.machine_code import disassemble

    config = _config(config_id)
    code = disassemble(compile_kernel(LightningChunkOutput, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)
    assert compile_seconds(LightningChunkOutput, config, target) > 0

    assert code.opcodes["HMMA.16816.F32.BF16"] == HMMA_PER_CHUNK
    assert code.count("HMMA") == HMMA_PER_CHUNK  # no other MMA flavour
    assert code.count("HGMMA") == 0 and code.count("UTCHMMA") == 0 and code.count("UTCQMMA") == 0  # no wgmma/tcgen05
    assert code.opcodes["LDSM.16.M88.4"] == LDSM_PER_CHUNK
    assert code.opcodes["LDSM.16.MT88.4"] == LDSM_T_PER_CHUNK
    assert code.opcodes["STSM.16.MT88.4"] == STSM_T_PER_CHUNK
    spills = code.count("LDL") + code.count("STL")
    assert spills <= measured(SPILLS, config_id, target), f"register spill: {spills} local loads + stores"
    # Per thread, per chunk: 16-byte cp.async of q, k (2 x 64 x 128 bf16) and v (64 x block_v), for both the
    # prologue and the in-loop prefetch.
    threads = config.block_v // 16 * 32
    per_chunk = (2 * C * K + C * config.block_v) // 8 // threads
    assert code.count("LDGSTS") == 2 * per_chunk
    # rows past the segment: the copies' own zero fill (source size 0), no 16-byte shared stores of zeros
    assert code.count("STS.128") == 0
    assert code.count("BAR.SYNC") == 2  # per chunk: tiles landed; the score tile complete
    assert code.count("MUFU.EX2") == 4  # the three decay tables and λ^64, once per CTA: no exp in the chunk loop
    assert code.opcodes["STG.E.128"] == C // 16  # o rows: one 16-byte store per row segment, nothing else stored
    # the score block: adjacent key pairs, 4 bytes per store (2 per n8 tile and lane), never single elements; the
    # prologue's decay tables: 4 stores
    assert code.opcodes["STS.U16"] == 0 and code.opcodes["STS"] == 2 * 2 + 4
    assert code.count("STG") == C // 16
    loop = chunk_loop(code.sass)
    assert len(loop) <= CHUNK_LOOP_MAX[config_id][target], f"chunk loop: {len(loop)} instructions"
    assert sum(op.startswith("HMMA") for op in loop) == HMMA_PER_CHUNK  # every MMA in it


# The direct form (every sequence one segment, from its initial state to its final state, one launch): no final state,
# h0/ht in both layouts, the pool in both dtypes and layouts (with the per-sequence flags)
DIRECT_CONFIGS = {
    "direct-no-state": dict(direct=True),
    "direct-h0-kv": dict(direct=True, has_initial_state=True),
    "direct-ht-kv": dict(direct=True, output_final_state=True),
    "direct-h0-ht-vk": dict(direct=True, has_initial_state=True, output_final_state=True, state_v_first=True),
    "direct-pool-fp32-kv": dict(direct=True, state_pool=True),
    "direct-pool-bf16-vk-flags": dict(direct=True, state_pool=True, state_dtype="bfloat16", state_v_first=True,
                                      initial_state_flags=True),
    # half-V CTAs (V block 64, 4 warps: two per sequence and head)
    "direct64-h0-ht-kv": dict(direct=True, block_v=64, has_initial_state=True, output_final_state=True),
    "direct64-no-state": dict(direct=True, block_v=64),
    "direct64-pool-bf16-vk-flags": dict(direct=True, block_v=64, state_pool=True, state_dtype="bfloat16",
                                        state_v_first=True, initial_state_flags=True),
    # over segments, each sequence's last segment ending in its final state (the prefill's segments form, with
    # kernels A and B skipping the last segments): ht in both layouts, the pool in both dtypes
    "segments-ht-kv": dict(output_final_state=True),
    "segments-ht-vk": dict(output_final_state=True, state_v_first=True),
    "segments-pool-fp32-kv": dict(state_pool=True),
    "segments-pool-bf16-vk": dict(state_pool=True, state_dtype="bfloat16", state_v_first=True),
}
DIRECT_DSL_FLOOR = ("direct-pool-bf16-vk-flags", "direct64-pool-bf16-vk-flags", "segments-pool-bf16-vk")
# measured with CuTeDSL 4.8.1: the chunk loop with the last chunk's state update in it (taken once, skipped by the
# other chunks) 1136-1176 instructions at V block 128; without a final state the default's 632-691; at V block 64
# (the score runs a loop, one warp's two runs) 1264-1316 with a final state on sm_90a
DIRECT_LOOP_MAX = {128: {"sm_90a": 1220, "sm_100a": 1200, "sm_103a": 1200},
                   64: {"sm_90a": 1360, "sm_100a": 1340, "sm_103a": 1340}}
DIRECT_NO_STATE_LOOP_MAX = {64: {"sm_90a": 800, "sm_100a": 760, "sm_103a": 760}}
# Local-memory spill instructions (LDL + STL) of the direct configurations, as measured per CuTeDSL minor version:
# none, but at V block 64 without a state on sm_100a / sm_103a with 4.8.1 (10: 64-bit pairs, 7 of them in the chunk
# loop; ptxas' choice, the same source spills nowhere else); 4.6.2 measured on the DSL-floor configurations only
DIRECT_SPILLS = {
    "4.8": {config_id: {target: 10 if config_id == "direct64-no-state" and target != "sm_90a" else 0 for target in SM}
            for config_id in DIRECT_CONFIGS},
    "4.6": {config_id: dict.fromkeys(SM, 0) for config_id in DIRECT_DSL_FLOOR},
}


@pytest.mark.parametrize(("config_id", "target"), [
    pytest.param(config_id, target, id=f"{config_id}-{target}",
                 marks=[pytest.mark.dsl_floor] if config_id in DIRECT_DSL_FLOOR else [])
    for config_id in DIRECT_CONFIGS for target in SM
])
def test_direct_form_machine_code(config_id: str, target: str) -> None:
    """The direct form: the default's chunk loop, plus (with a final state) the last chunk's state update (its 64
    MMAs and 32 kᵀ ldmatrix.trans, in the loop behind a branch), its key factors and λ^L (17 exp2: 16 distinct
    tokens per thread and one), the start state's loads and the final state's stores, whole 8-byte pairs where
    the state is V-first (k contiguous: two accumulator columns), 4-byte elements where it is K-first; no spill.
    The same per thread in half-V CTAs (a warp's 16 value rows, its MMAs, its score code once: a loop over its
    runs), with fewer v copies per thread. Over segments with a final state the same, the start state read from
    ``seg_state`` (K-first: 64 4-byte loads) and the row's sequence and last mark read besides."""
    from cula_runtime.cute.compile_cache import compile_kernel
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput, LightningChunkOutputConfig
    from cula_runtime.cute.machine_code import disassemble

    fields = DIRECT_CONFIGS[config_id]
    config = LightningChunkOutputConfig(num_heads=64, **fields)
    code = disassemble(compile_kernel(LightningChunkOutput, config, target=target))
    block_v = config.block_v
    final = config.writes_final_state
    v_first = fields.get("state_v_first", False)
    state_accesses = 32 if v_first else 64  # per thread: 64 fp32 elements of Sᵀ, in pairs where k is contiguous
    assert code.count("HMMA") == code.opcodes["HMMA.16816.F32.BF16"] == HMMA_PER_CHUNK + 64 * final
    assert code.count("HGMMA") == 0 and code.count("UTCHMMA") == 0 and code.count("UTCQMMA") == 0
    assert code.opcodes["LDSM.16.M88.4"] == LDSM_PER_CHUNK
    assert code.opcodes["LDSM.16.MT88.4"] == LDSM_T_PER_CHUNK + 32 * final
    assert code.opcodes["STSM.16.MT88.4"] == STSM_T_PER_CHUNK
    spills = code.count("LDL") + code.count("STL")
    assert spills <= measured(DIRECT_SPILLS, config_id, target), f"register spill: {spills} local loads + stores"
    assert code.count("BAR.SYNC") == 2
    assert code.count("MUFU.EX2") == 4 + 17 * final
    pool = fields.get("state_pool", False)  # (a pool call's padding rows: a second set of row stores, of zeros)
    assert code.count("STG") == C // 16 * (1 + pool) + state_accesses * final
    reads_state = fields.get("has_initial_state", False) or fields.get("state_pool", False)
    indices = fields.get("state_pool", False) + fields.get("initial_state_flags", False)
    # the segment row (sequence, first row, length, last mark) in one 16-byte load where the sequence is needed (a
    # state read or written), else its first row and length alone; the head's decay; then
    needs_sequence = final or reads_state
    assert code.opcodes.get("LDG.E.128", 0) == needs_sequence
    if config.direct:  # the slot, the flag, h0 or the slot's state
        assert code.count("LDG") == (2 if needs_sequence else 3) + indices + state_accesses * reads_state
    else:  # seg_state's start state (K-first), the last mark again, the slot
        assert code.count("LDG") == 2 + 64 + 1 + indices
    # q, k (2 x 64 x 128 bf16) and v (64 x block_v) in 16-byte cp.async per thread, prologue and prefetch
    assert code.count("LDGSTS") == 2 * (2 * C * K + C * block_v) // 8 // (block_v // 16 * 32)
    loop = chunk_loop(code.sass)
    if final:
        loop_max = DIRECT_LOOP_MAX[block_v][target]
    else:
        loop_max = CHUNK_LOOP_MAX["bv128-H64"][target] if block_v == 128 else DIRECT_NO_STATE_LOOP_MAX[64][target]
    assert len(loop) <= loop_max, f"chunk loop: {len(loop)} instructions"
    assert sum(op.startswith("HMMA") for op in loop) == HMMA_PER_CHUNK + 64 * final


def chunk_loop(sass: str) -> list[str]:
    """Opcodes (NOP excluded) of the longest backward branch's range in ``sass``: the chunk loop."""
    import re

    labels: dict[str, int] = {}
    ops: list[tuple[str, str]] = []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
        inst = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)(.*)$", line)
        if inst and inst.group(1) != "NOP":
            ops.append((inst.group(1), inst.group(2)))
    spans = [(labels[target.group(1)], i) for i, (op, rest) in enumerate(ops)
             if op.startswith("BRA") and (target := re.search(r"(\.L_x_\d+)", rest)) and target.group(1) in labels
             and labels[target.group(1)] <= i]
    assert spans, "no loop in the machine code"
    first, last = max(spans, key=lambda span: span[1] - span[0])
    return [op for op, _ in ops[first:last + 1]]


def test_one_binary_serves_every_length() -> None:
    """Every extent of every tensor argument is symbolic: one compilation for any token or segment count."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput

    config = _config("bv128-H64")
    for spec in LightningChunkOutput(config).argument_specs():
        if spec is None:  # (the direct form's states: absent here)
            continue
        fake = spec.fake()
        assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)
    compiled = compile_cache.compile_kernel(LightningChunkOutput, config, target="sm_90a")
    assert compile_cache.compile_kernel(LightningChunkOutput, config, target="sm_90a") is compiled


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_dim": 64}, "only K = V = 128"),
        ({"chunk_size": 32}, "only 64"),
        ({"block_v": 64}, "block_v=64 serves only the direct form"),
        ({"block_v": 32, "direct": True}, "block_v=32: expected 128 or (the direct form) 64"),
        ({"num_heads": 0}, "num_heads"),
        ({"has_initial_state": True}, "belong to the direct form"),
        ({"state_pool": True, "initial_state_flags": True}, "belong to the direct form"),
        ({"direct": True, "state_pool": True, "output_final_state": True}, "state_pool reads and writes the pool"),
        ({"direct": True, "state_dtype": "bfloat16"}, "a bf16 state needs state_pool"),
        ({"direct": True, "state_dtype": "float16"}, "expected one of"),
    ],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput

    config = dataclasses.replace(_config("bv128-H64"), **changes)
    ok, why = LightningChunkOutput.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        LightningChunkOutput(config)


@pytest.mark.parametrize("warps", [8, 4])
def test_score_blocks_cover_the_lower_triangle_once(warps: int) -> None:
    """Every lower 16 x 16 block (J <= I) of the 64 x 64 score tile is made by exactly one of the CTA's warps (8: V
    block 128, each warp's blocks one run, the kernel reads the word's first run only; 4: the direct form's half-V
    CTAs, 2 or 3 blocks a warp, one warp with two runs), and the runs the kernel decodes from each warp's word name
    exactly that warp's blocks."""
    from cula_runtime.cute.lightning.chunk_output import _SCORE_BLOCKS, _rows_of, _score_word

    per_warps = _SCORE_BLOCKS[warps]
    blocks = [block for per_warp in per_warps for block in per_warp]
    assert len(per_warps) == warps and sorted(blocks) == [(i, j) for i in range(4) for j in range(i + 1)]
    runs_per_warp = [len(_rows_of(per_warp)) for per_warp in per_warps]
    assert runs_per_warp == ([1] * 8 if warps == 8 else [1, 1, 1, 2])
    assert sorted(len(per_warp) for per_warp in per_warps) == ([1] * 6 + [2] * 2 if warps == 8 else [2, 2, 3, 3])
    for per_warp in per_warps:
        word = _score_word(per_warp)
        assert word & 15 == len(_rows_of(per_warp))
        decoded = []
        for r in range(word & 15):
            run = word >> (4 + 8 * r) & 255  # as the kernel reads it
            decoded += [(run & 3, (run >> 2 & 3) + t) for t in range(run >> 4)]
        assert decoded == list(per_warp)
    with pytest.raises(ValueError, match="not adjacent"):
        _score_word(((3, 0), (3, 2)))


def test_row_blocks_lie_above_the_swizzle() -> None:
    """The kernel reads a warp's 16-row blocks of the swizzled q and k tiles by moving the pointer of block 0 on by
    ``_ROW_BLOCK`` elements per block: in the (64, 128, 2) tile's layout, row 16 I + r is row r plus that offset,
    whatever the column and stage (the swizzle permutes bits below it)."""
    import cutlass.cute as cute

    from cula_runtime.cute.lightning.chunk_output import _ROW_BLOCK, LightningChunkOutput, LightningChunkOutputConfig

    kernel = LightningChunkOutput(LightningChunkOutputConfig(num_heads=1))
    pairs = []

    @cute.jit
    def probe():
        layout = kernel._smem_layout(C, K, 2)
        for bi in tuple(range(4)):
            for r in tuple(range(16)):
                for col in tuple(range(0, K, 3)):
                    for stage in tuple(range(2)):
                        pairs.append((bi, cute.crd2idx((16 * bi + r, col, stage), layout),
                                      cute.crd2idx((r, col, stage), layout)))

    probe()
    assert len(pairs) == 4 * 16 * len(range(0, K, 3)) * 2
    assert all(int(moved) == int(first) + _ROW_BLOCK * bi for bi, moved, first in pairs)


def _traced_per_thread(make_mma, threads, per_thread, extra=None) -> dict:
    """Traced on the host with static thread indices: ``{thread: per_thread(make_mma().get_slice(thread))}`` for
    each of ``threads`` (and ``extra()`` under ``"extra"`` when given), the coordinates inside still CuTe integers.
    (Both calls run in the traced function without a branch: the DSL rewrites a Python ``if`` there.)"""
    import cutlass.cute as cute

    seen = {}
    extras = () if extra is None else (extra,)

    @cute.jit
    def probe():
        mma = make_mma()
        for thread in tuple(threads):
            seen[thread] = per_thread(mma.get_slice(thread))
        for make_extra in extras:
            seen["extra"] = make_extra()

    probe()
    return seen


def test_score_fragment_coordinates() -> None:
    """Traced on the host with static lane indices: in the one-warp score MMA's partition of the whole 64 x 64 tile,
    modes (I, 2J + h) hold exactly the (query, key) coordinates of n8 tile h of block (I, J)'s accumulator (the
    kernel computes a block's values from the block's coordinates and stores them through the whole tile's
    partition), and each lane's pairs are adjacent keys (one 4-byte store each)."""
    import cutlass.cute as cute

    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput, LightningChunkOutputConfig

    kernel = LightningChunkOutput(LightningChunkOutputConfig(num_heads=1))

    def pairs(thr):
        block = thr.partition_C(cute.make_identity_tensor((16, 16)))
        whole = thr.partition_C(cute.make_identity_tensor((C, C)))
        return [((bi * 16 + block[v, 0, half][0], bj * 16 + block[v, 0, half][1]),
                 (whole[v, bi, 2 * bj + half][0], whole[v, bi, 2 * bj + half][1]))
                for bi in range(4) for bj in range(bi + 1) for half in range(2) for v in range(4)]

    seen = _traced_per_thread(kernel.make_score_mma, range(32), pairs)
    assert sorted(seen) == list(range(32))
    covered = set()
    for lane, pairs in seen.items():
        for expected, got in pairs:
            assert tuple(int(x) for x in expected) == tuple(int(x) for x in got), lane
            covered.add(tuple(int(x) for x in got))
        keys = [(int(g[0]), int(g[1])) for _, g in pairs]
        for a, b in zip(keys[0::2], keys[1::2], strict=True):  # elements (0, 1) and (2, 3) of each n8 tile
            assert b == (a[0], a[1] + 1) and a[1] % 2 == 0, lane
    assert covered == {(i, j) for i in range(C) for j in range(C) if j // 16 <= i // 16}


def test_diagonal_mask_words() -> None:
    """Traced on the host with static lane indices: the kernel clears a diagonal score block's elements with key >
    row by ANDing its four packed bf16 pairs (elements 2k, 2k + 1 of the block's fragment): pairs 0 and 3 with
    ``keep`` (made from elements 0 and 1), pair 2 with 0 (all masked), pair 1 kept; off the diagonal all are kept.
    That is exactly ``key <= row`` for every element of every lane."""
    import cutlass.cute as cute

    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput, LightningChunkOutputConfig

    kernel = LightningChunkOutput(LightningChunkOutputConfig(num_heads=1))

    def coordinates(thr):
        block = thr.partition_C(cute.make_identity_tensor((16, 16)))
        return [(block[e][0], block[e][1]) for e in range(8)]

    seen = _traced_per_thread(kernel.make_score_mma, range(32), coordinates, extra=lambda: str(
        cute.recast_layout(32, 16, cute.make_layout(((2, 2), 1, 2)))))
    assert seen.pop("extra") == "((1,2),1,2):((1,1),0,2)"  # pair k of the recast = elements 2k, 2k + 1
    for lane, coords in seen.items():
        (i0, j0), (i1, j1) = coords[0], coords[1]
        keep = (0xFFFF if int(j0) <= int(i0) else 0) | (0xFFFF0000 if int(j1) <= int(i1) else 0)
        words = [keep, 0xFFFFFFFF, 0, keep]
        for e, (i, j) in enumerate(coords):
            kept = words[e // 2] >> (16 * (e % 2)) & 0xFFFF == 0xFFFF
            assert kept == (int(j) <= int(i)), (lane, e)


def test_token_fragments_chain_as_operand_a() -> None:
    """Traced on the host with static thread indices: a (block_v x 64 tokens) accumulator-layout fragment (vᵀ, read
    with ldmatrix.trans in that layout) viewed as the A operand holds exactly the A operand's coordinates, and warp
    w owns value rows 16w..16w+15 (the o staging over its own v columns relies on it)."""
    import cutlass.cute as cute

    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput, LightningChunkOutputConfig

    block_v = 128
    kernel = LightningChunkOutput(LightningChunkOutputConfig(num_heads=1, block_v=block_v))
    threads = list(range(0, kernel.num_threads, 11))

    def fragments(thr):
        acc = thr.partition_C(cute.make_identity_tensor((block_v, C)))
        frag_a = kernel._acc_as_operand_a(acc)
        op_a = thr.partition_A(cute.make_identity_tensor((block_v, C)))
        return ([acc[i] for i in range(cute.size(acc))],
                [frag_a[v, 0, kb] for kb in range(C // 16) for v in range(8)],
                [op_a[v, 0, kb] for kb in range(C // 16) for v in range(8)])

    seen = _traced_per_thread(kernel.make_tiled_mma, threads, fragments)
    assert sorted(seen) == threads
    for tidx, (acc, frag_a, op_a) in seen.items():
        assert [tuple(int(x) for x in c) for c in frag_a] == [tuple(int(x) for x in c) for c in op_a], tidx
        row = 16 * (tidx // 32) + tidx % 32 // 4
        assert {int(c[0]) for c in acc} == {row, row + 8}, tidx
