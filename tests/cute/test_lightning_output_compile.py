"""CuTeDSL compilation of kernel C of the Lightning prefill (LightningChunkOutput) on the CPU, for sm_90a, sm_100a
and sm_103a: the machine code holds exactly the warp-level bf16 MMAs, ldmatrix/stmatrix and cp.async traffic of one
64-token chunk in its (not unrolled) chunk loop, its exp2 only in the prologue (the decay tables), two CTA barriers
per chunk, and its local-memory spills are the ones measured with the installed CuTeDSL.

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

# LightningChunkOutputConfig fields of the compiled configurations: both V blocks
CONFIGS = {
    "bv64-H16": dict(num_heads=16, block_v=64),
    "bv128-H64": dict(num_heads=64, block_v=128),
}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = ("bv64-H16",)
# Local-memory spill instructions (LDL + STL) per CuTeDSL minor version, configuration and target, as measured: a
# few loop invariants (the next chunk's row addresses) saved before the chunk loop and reloaded in it.
SPILLS = {
    "4.6": {
        "bv64-H16": {"sm_90a": 10, "sm_100a": 10, "sm_103a": 10},
    },
    "4.8": {
        "bv64-H16": {"sm_90a": 10, "sm_100a": 10, "sm_103a": 10},
        "bv128-H64": {"sm_90a": 10, "sm_100a": 10, "sm_103a": 10},
    },
}

# Per chunk and warp (16 value rows): q·S 8 k-blocks x 8 token tiles, vᵀ·Pᵀ 2 x (4 + 3 + 2 + 1) tiles, the state
# 4 token blocks x 16 K tiles; the score tile's 10 lower 16 x 16 blocks (2 n8 tiles x 8 k-blocks each), each in
# the code of the one warp that makes it.
SCORE_BLOCKS = 10
HMMA_PER_CHUNK = 64 + 20 + 64 + SCORE_BLOCKS * 16
# ldmatrix x4 per chunk: q 8 k-blocks x 4, P 4 + 3 + 2 + 1 (upper blocks are never loaded), a score block's q rows
# and k rows 8 + 8; transposed: kᵀ 4 token blocks x 8, vᵀ 4. stmatrix.trans x4: oᵀ 4.
LDSM_PER_CHUNK = 32 + 10 + SCORE_BLOCKS * 16
LDSM_T_PER_CHUNK = 32 + 4
STSM_T_PER_CHUNK = 4


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
    assert code.count("BAR.SYNC") == 2  # per chunk: tiles landed; the score tile complete
    assert code.count("MUFU.EX2") == 4  # the three decay tables and λ^64, once per CTA: no exp in the chunk loop
    assert code.opcodes["STG.E.128"] == C // 16  # o rows: one 16-byte store per row segment, nothing else stored
    assert code.count("STG") == C // 16


def test_one_binary_serves_every_length() -> None:
    """Every extent of every tensor argument is symbolic: one compilation for any token or segment count."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput

    config = _config("bv64-H16")
    for spec in LightningChunkOutput(config).argument_specs():
        fake = spec.fake()
        assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)
    compiled = compile_cache.compile_kernel(LightningChunkOutput, config, target="sm_90a")
    assert compile_cache.compile_kernel(LightningChunkOutput, config, target="sm_90a") is compiled


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_dim": 64}, "only K = V = 128"),
        ({"chunk_size": 32}, "only 64"),
        ({"block_v": 32}, "block_v=32: expected one of (64, 128)"),
        ({"num_heads": 0}, "num_heads"),
    ],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.lightning.chunk_output import LightningChunkOutput

    config = dataclasses.replace(_config("bv64-H16"), **changes)
    ok, why = LightningChunkOutput.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        LightningChunkOutput(config)


@pytest.mark.parametrize("block_v", [64, 128])
def test_score_blocks_cover_the_lower_triangle_once(block_v: int) -> None:
    """Every lower 16 x 16 block (J <= I) of the 64 x 64 score tile is made by exactly one warp."""
    from cula_runtime.cute.lightning.chunk_output import _SCORE_BLOCKS

    blocks = [block for per_warp in _SCORE_BLOCKS[block_v // 16] for block in per_warp]
    assert len(_SCORE_BLOCKS[block_v // 16]) == block_v // 16
    assert sorted(blocks) == [(i, j) for i in range(4) for j in range(i + 1)]
