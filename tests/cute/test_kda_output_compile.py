"""CuTeDSL compilation of the KDA chunk-output kernel (``chunk_kda_fwd_o``) on the CPU: it builds for sm_90a,
sm_100a and sm_103a as warp-MMA code (bf16 HMMA fed by ldmatrix) with no register spills, and does the fused
recurrence's output products exactly (the same MMA count). Skips without CuTeDSL and TVM-FFI.
"""

from __future__ import annotations

import dataclasses

import pytest

from cula_runtime import cute as cula_cute

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(
        not cula_cute.is_available(), reason='CuTeDSL or TVM-FFI is not installed (pip install "cula-runtime[cute]")'
    ),
]

SM = {"sm_90a": "SM90", "sm_100a": "SM100", "sm_103a": "SM103"}
CONFIGS = {
    "fixed-bv64-HV4-kv": dict(num_v_heads=4),
    "varlen-bv32-HV2-vk": dict(num_v_heads=2, block_v=32, varlen=True, state_v_first=True),
    "varlen-bv128-HV8-kv": dict(num_v_heads=8, block_v=128, varlen=True),
}
# per warp: qg·h 8 k-blocks x 8 token tiles, the causal Aqk·v_new 2 x (4 + 3 + 2 + 1): as in the fused recurrence
HMMA = 64 + 20


@pytest.mark.parametrize("target", list(SM))
@pytest.mark.parametrize("config_id", list(CONFIGS))
def test_kda_output_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.compile_cache import compile_kernel
    from cula_runtime.cute.kda.output import KdaOutput, KdaOutputConfig
    from cula_runtime.cute.machine_code import disassemble

    config = KdaOutputConfig(**CONFIGS[config_id])
    code = disassemble(compile_kernel(KdaOutput, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)
    assert code.opcodes["HMMA.16816.F32.BF16"] == HMMA and code.count("HMMA") == HMMA
    assert code.count("HGMMA") == 0 and code.count("UTCHMMA") == 0
    # ldmatrix x4: qg 8 x 4 and Aqk 4 + 3 + 2 + 1 plain; v_newᵀ 4 transposed; hᵀ 8, transposed unless V-first
    h_plain = 8 if config.state_v_first else 0
    assert code.opcodes["LDSM.16.M88.4"] == 32 + 10 + h_plain
    assert code.opcodes["LDSM.16.MT88.4"] == 4 + 8 - h_plain
    assert code.opcodes["STSM.16.MT88.4"] == 4  # oᵀ staged once
    assert code.opcodes["STG.E.128"] == 4  # o rows, 16 bytes per row segment
    assert code.count("LDGSTS") > 0 and code.count("BAR.SYNC") >= 1
    assert code.count("LDL") == 0 and code.count("STL") == 0, "register spill"


@pytest.mark.parametrize(
    ("changes", "reason"),
    [({"head_dim": 64}, "only K = V = 128"), ({"block_v": 16}, "block_v"), ({"num_v_heads": 0}, "num_v_heads")],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.kda.output import KdaOutput, KdaOutputConfig

    config = dataclasses.replace(KdaOutputConfig(num_v_heads=1), **changes)
    ok, why = KdaOutput.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        KdaOutput(config)
