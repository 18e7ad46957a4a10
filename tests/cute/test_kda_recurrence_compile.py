"""CuTeDSL compilation of the fused delta-h + output kernel (KdaRecurrence) on the CPU, for sm_90a, sm_100a and
sm_103a: the machine code holds exactly the warp-level bf16 MMAs, ldmatrix/stmatrix and cp.async traffic of one
64-token chunk in its (not unrolled) chunk loop, and its local-memory spills are the ones measured with the installed
CuTeDSL (none). The state-pool configurations (the slot read on the device, fp32 or bf16, the per-sequence
``has_initial_state`` byte) add no MMA and no shared-memory traffic: only the pool's loads and stores, at the width
of the state's element pairs, and the padding row's zero o rows.

Needs CuTeDSL and TVM-FFI (cula-runtime brings them on Linux x86_64/aarch64); skips cleanly without them.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.cute.compile_helpers import COMPILE_MARKS, SM, assert_measured_spills, compile_machine_code, compile_params

pytestmark = COMPILE_MARKS
C, K = 64, 128

# KdaRecurrenceConfig fields of the compiled configurations: together both block_v (64, 128), fixed and varlen
# (sequences longest first), with and without h0 and the final state, both state layouts
PLAIN_CONFIGS = {
    "fixed-bv64-HV4": dict(num_v_heads=4),
    "varlen-bv64-HV4-h0-ht-vk": dict(num_v_heads=4, varlen=True, has_initial_state=True, output_final_state=True,
                                     state_v_first=True),
    "fixed-bv128-HV2-h0-ht-kv": dict(num_v_heads=2, block_v=128, has_initial_state=True, output_final_state=True),
    "varlen-bv128-HV8-ht-kv": dict(num_v_heads=8, block_v=128, varlen=True, output_final_state=True),
}
# the state pool: together both dtypes, both layouts, both block_v, fixed and varlen, with and without the flags
POOL_CONFIGS = {
    "pool-varlen-bv64-HV4-fp32-vk-flags": dict(num_v_heads=4, varlen=True, state_pool=True, state_v_first=True,
                                               initial_state_flags=True),
    "pool-fixed-bv128-HV2-bf16-kv-flags": dict(num_v_heads=2, block_v=128, state_pool=True, state_dtype="bfloat16",
                                               initial_state_flags=True),
    "pool-varlen-bv64-HV8-bf16-vk": dict(num_v_heads=8, varlen=True, state_pool=True, state_dtype="bfloat16",
                                         state_v_first=True),
}
CONFIGS = {**PLAIN_CONFIGS, **POOL_CONFIGS}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = ("varlen-bv64-HV4-h0-ht-vk", "pool-varlen-bv64-HV4-fp32-vk-flags")
# Local-memory spill instructions per CuTeDSL minor version, configuration and target, as measured: none (the pool
# configurations were measured with 4.6 and 4.8 only).
SPILLS = {version: {config_id: dict.fromkeys(SM, 0) for config_id in (PLAIN_CONFIGS if version == "4.7" else CONFIGS)}
          for version in ("4.6", "4.7", "4.8")}

# Per chunk and warp (16 value rows): w·S 8 k-blocks x 8 token tiles, qg·S the same, kgᵀ·v_new 4 x 16 K tiles,
# and the causal Aqk·v_new 2 x (4 + 3 + 2 + 1) tiles.
HMMA_PER_CHUNK = 64 + 64 + 64 + 20
# ldmatrix x4 per chunk: w and qg 8 k-blocks x 4 each; Aqk 4 + 3 + 2 + 1 (upper blocks are never loaded);
# transposed: kg 4 token blocks x 8, uᵀ 4. stmatrix.trans x4: oᵀ 4.
LDSM_PER_CHUNK = 32 + 32 + 10
LDSM_T_PER_CHUNK = 32 + 4
STSM_T_PER_CHUNK = 4


def _config(config_id: str):
    from cula_runtime.cute.kda.recurrence import KdaRecurrenceConfig

    return KdaRecurrenceConfig(**CONFIGS[config_id])


@pytest.mark.parametrize(("config_id", "target"), compile_params(CONFIGS, DSL_FLOOR))
def test_kda_recurrence_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.kda.recurrence import KdaRecurrence

    config = _config(config_id)
    code = compile_machine_code(KdaRecurrence, config, target)

    assert code.opcodes["HMMA.16816.F32.BF16"] == HMMA_PER_CHUNK
    assert code.count("HMMA") == HMMA_PER_CHUNK  # no other MMA flavour
    assert code.opcodes["LDSM.16.M88.4"] == LDSM_PER_CHUNK
    assert code.opcodes["LDSM.16.MT88.4"] == LDSM_T_PER_CHUNK
    assert code.opcodes["STSM.16.MT88.4"] == STSM_T_PER_CHUNK
    assert_measured_spills(code, SPILLS, config_id, target)
    assert code.count("HGMMA") == 0 and code.count("UTCHMMA") == 0  # warp-level MMA only: one source for every SM
    # Per thread, per chunk: 16-byte cp.async of w, qg, kg (3 x 64 x 128 bf16), u (64 x block_v), Aqk (64 x 64)
    # for both the prologue and the in-loop prefetch, plus the decay row (16 bytes on 32 threads).
    threads = config.block_v // 16 * 32
    per_chunk = (3 * C * K + C * config.block_v + C * C) // 8 // threads
    assert code.count("LDGSTS") >= 2 * per_chunk
    assert code.count("BAR.SYNC") >= 1
    assert code.count("MUFU.EX2") >= K // 32  # exp2 of the chunk's decay row, K / 32 channels per lane
    assert code.count("STG.E.128") >= C // 16  # o rows: one 16-byte store per row segment
    if config.output_final_state:
        store = "STG.E.64" if config.state_v_first else "STG.E"  # K-contiguous pairs, or single V-strided floats
        assert code.opcodes[store] >= K // 8 * 2
    if config.state_pool:
        # The thread's 64 state elements, read once from the slot and written once back: 32 K-contiguous pairs
        # (V-first: 8 bytes fp32, 4 bytes bf16) or 64 V-strided single elements.
        pairs = config.state_v_first
        width = {("float32", True): ".64", ("float32", False): "", ("bfloat16", True): "",
                 ("bfloat16", False): ".U16"}[(config.state_dtype, pairs)]
        accesses = K // 8 * (2 if pairs else 4)
        assert code.opcodes["LDG.E" + width] >= accesses and code.opcodes["STG.E" + width] >= accesses
        if config.state_dtype == "bfloat16":  # every fp32 store is a state store of another width: none here
            assert code.opcodes["STG.E.64"] == 0 and (pairs or code.opcodes["STG.E"] == 0)
        assert code.opcodes["LDG.E.U8"] == (1 if config.initial_state_flags else 0)  # the has_initial_state byte
        assert code.opcodes["STG.E.128"] == 2 * C // 16  # o rows, and a padding row's zero rows
    else:
        assert code.opcodes["LDG.E.U8"] == 0


def test_one_binary_serves_every_length() -> None:
    """Every extent of every tensor argument is symbolic: one compilation for any T, B, N or cu_seqlens."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.recurrence import KdaRecurrence

    config = _config("varlen-bv64-HV4-h0-ht-vk")
    for spec in KdaRecurrence(config).argument_specs():
        if spec is not None:
            fake = spec.fake()
            assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)
    compiled = compile_cache.compile_kernel(KdaRecurrence, config, target="sm_90a")
    assert compile_cache.compile_kernel(KdaRecurrence, config, target="sm_90a") is compiled


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_dim": 64}, "only K = V = 128"),
        ({"chunk_size": 32}, "only 64"),
        ({"block_v": 16}, "block_v"),
        ({"block_v": 32}, "block_v=32: expected one of (64, 128)"),  # the retired 2-warp form
        ({"num_v_heads": 0}, "num_v_heads"),
        ({"state_dtype": "bfloat16"}, "a bf16 state needs state_pool"),
        ({"initial_state_flags": True}, "needs state_pool"),
        ({"state_pool": True, "has_initial_state": True}, "has_initial_state and output_final_state must be False"),
        ({"state_pool": True, "output_final_state": True}, "has_initial_state and output_final_state must be False"),
        ({"state_pool": True, "state_dtype": "float16"}, "state_dtype='float16': expected one of"),
    ],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.kda.recurrence import KdaRecurrence

    config = dataclasses.replace(_config("fixed-bv64-HV4"), **changes)
    ok, why = KdaRecurrence.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        KdaRecurrence(config)


@pytest.mark.parametrize("block_v", [64, 128])
def test_fragment_layouts_the_kernel_relies_on(block_v: int) -> None:
    """Traced on the host with static thread indices: warp w owns value rows 16w..16w+15 (the u/o staging and the
    o store use the warp's own columns), and two adjacent n8 accumulator tiles are one k16 A fragment (the
    C -> A register reuse of Sᵀ_bf and v_newᵀ)."""
    import cutlass.cute as cute

    from cula_runtime.cute.kda.recurrence import KdaRecurrence, KdaRecurrenceConfig

    kernel = KdaRecurrence(KdaRecurrenceConfig(num_v_heads=1, block_v=block_v))
    threads = list(range(0, kernel.num_threads, 13))
    seen = {}  # tidx -> (accumulator coordinates, A-view coordinates, A-operand coordinates), static values

    @cute.jit
    def probe():
        tiled_mma = kernel.make_tiled_mma()
        for tidx in tuple(threads):
            thr = tiled_mma.get_slice(tidx)
            acc = thr.partition_C(cute.make_identity_tensor((block_v, K)))
            frag_a = KdaRecurrence._acc_as_operand_a(acc)
            op_a = thr.partition_A(cute.make_identity_tensor((block_v, K)))
            seen[tidx] = (
                [acc[i] for i in range(cute.size(acc))],
                [frag_a[v, 0, kb] for kb in range(K // 16) for v in range(8)],
                [op_a[v, 0, kb] for kb in range(K // 16) for v in range(8)],
            )

    probe()
    assert sorted(seen) == threads
    for tidx, (acc, frag_a, op_a) in seen.items():
        assert [tuple(int(x) for x in c) for c in frag_a] == [tuple(int(x) for x in c) for c in op_a], tidx
        row = 16 * (tidx // 32) + tidx % 32 // 4
        assert {int(c[0]) for c in acc} == {row, row + 8}, tidx
        assert len({tuple(int(x) for x in c) for c in acc}) == 2 * K // 4  # 64 distinct (row, column) pairs
