"""CuTeDSL compilation of the KDA decode kernel (KdaDecode) on the CPU, for sm_90a, sm_100a and sm_103a: the machine
code moves the state with 16-byte global loads and stores only, reduces over K with warp shuffles only (no shared
memory, no barrier, no MMA of any kind), and its local-memory spills are the ones measured with the installed
CuTeDSL.

Three configurations cover the kernel's code paths: a T = 1 fp32 pool in the K-first layout (the serving case);
packed sequences with per-token slots and accepted counts, the V-first fp32 layout, the L2 norm and the lower-bound
gate from bf16 g and β logits; a bf16 pool in the V-first layout with the softplus gate.

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

# KdaDecodeConfig fields (the gate as InKernelGate fields) of the compiled configurations
CONFIGS = {
    "T1-fp32-kv-H4-HV8": dict(num_heads=4, num_v_heads=8),
    "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8": dict(
        num_heads=2, num_v_heads=8, varlen=True, per_token_slots=True, num_accepted=True, l2norm=True,
        state_v_first=True,
        gate=dict(form="safe", g_dtype="bfloat16", beta_dtype="bfloat16", has_A_log=True, has_dt_bias=True,
                  beta_sigmoid=True, allow_neg_eigval=True)),
    "bf16-vk-softplus-H8-HV8": dict(
        num_heads=8, num_v_heads=8, state_dtype="bfloat16", state_v_first=True,
        gate=dict(form="softplus", has_A_log=True, has_dt_bias=True, beta_sigmoid=True)),
}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8"
# Local-memory spill instructions (LDL + STL) per CuTeDSL minor version, configuration and target, as measured. The
# fp32 pool runs at 96 registers (5 CTAs per SM; decode.MIN_BLOCKS_PER_SM), where ptxas spills a few values.
SPILLS = {
    "4.6": {
        "T1-fp32-kv-H4-HV8": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8": {"sm_90a": 43, "sm_100a": 0, "sm_103a": 0},
        "bf16-vk-softplus-H8-HV8": {"sm_90a": 8, "sm_100a": 16, "sm_103a": 16},
    },
    "4.8": {
        "T1-fp32-kv-H4-HV8": {"sm_90a": 12, "sm_100a": 13, "sm_103a": 16},
        "varlen-slots-accepted-fp32-vk-l2-safe-bf16gb-H2-HV8": {"sm_90a": 27, "sm_100a": 0, "sm_103a": 0},
        "bf16-vk-softplus-H8-HV8": {"sm_90a": 8, "sm_100a": 12, "sm_103a": 10},
    },
}


def _config(config_id: str):
    from cula_runtime.cute.kda.decode import KdaDecodeConfig
    from cula_runtime.cute.kda.intra import InKernelGate

    fields = dict(CONFIGS[config_id])
    if "gate" in fields:
        fields["gate"] = InKernelGate(**fields["gate"])
    return KdaDecodeConfig(**fields)


@pytest.mark.parametrize(("config_id", "target"), [
    pytest.param(config_id, target, id=f"{config_id}-{target}",
                 marks=[pytest.mark.dsl_floor] if config_id == DSL_FLOOR else [])
    for config_id in CONFIGS for target in SM
])
def test_kda_decode_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.compile_cache import compile_kernel, compile_seconds
    from cula_runtime.cute.kda.decode import KdaDecode
    from cula_runtime.cute.machine_code import disassemble

    config = _config(config_id)
    kernel = KdaDecode(config)
    code = disassemble(compile_kernel(KdaDecode, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)
    assert compile_seconds(KdaDecode, config, target) > 0

    # SIMT only: no MMA of any flavour, no shared memory, no barrier (the reductions over K stay in a warp)
    for prefix in ("HMMA", "HGMMA", "UTCHMMA", "UTCQMMA", "UTCMMA", "LDS", "STS", "BAR"):
        assert code.count(prefix) == 0, prefix
    assert not [op for op in code.opcodes if op.startswith("UTC")]
    # The state: 8 16-byte vectors per lane, loaded once and stored once per call (T = 1, [N] indices), or after
    # every token with [N, W] indices (the peeled first token and the token loop each store them).
    state_stores = 16 if config.per_token_slots else 8
    assert code.opcodes["LDG.E.128"] >= 8
    assert code.opcodes["STG.E.128"] >= state_stores
    # o: one 8-byte (fp32 pool: 4 columns per lane) or 16-byte (bf16 pool: 8) store per token, in the padding
    # row's zero loop and the two copies of the token step
    o_store = "STG.E.64" if kernel.cols == 4 else "STG.E.128"
    assert code.opcodes[o_store] == 3 + (state_stores if o_store == "STG.E.128" else 0)
    assert not any(op.startswith("STG") and op not in ("STG.E.128", "STG.E.64") for op in code.opcodes), \
        "every store is a vector (state 16 bytes, o 8 or 16 bytes)"
    # One shfl.bfly all-reduce of 4 steps over the 16 lanes of a column group per reduced value: q·k, kᵀS and qᵀS
    # of the lane's columns (and Σq², Σk² with the L2 norm), in each of the two copies of the token step.
    values = 1 + 2 * kernel.cols + (2 if config.l2norm else 0)
    assert code.opcodes["SHFL.BFLY"] == 2 * 4 * values
    assert code.count("MUFU.EX2") >= 8  # the decay of the lane's 8 K rows
    spills = code.count("LDL") + code.count("STL")
    assert spills <= measured(SPILLS, config_id, target), f"register spill: {spills} local loads + stores"


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
