"""CuTeDSL compilation of the KDA chunk-intra kernel on the CPU (no GPU): it builds for sm_90a, sm_100a and sm_103a,
its machine code is warp-MMA code (bf16 HMMA fed by ldmatrix, no wgmma or tcgen05) with no register spills, and the
global-memory traffic is the 16-byte accesses we expect. Skips without CuTeDSL and TVM-FFI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cula_runtime import cute as cula_cute

pytestmark = [
    pytest.mark.compile,
    pytest.mark.skipif(
        not cula_cute.is_available(), reason='CuTeDSL or TVM-FFI is not installed (pip install "cula-runtime[cute]")'
    ),
]

SM = {"sm_90a": "SM90", "sm_100a": "SM100", "sm_103a": "SM103"}
# Configurations compiled for sm_90a only: on sm_100a and sm_103a each repeats a variant and features that another
# configuration compiles there (the wide plan fixed and at K = 64, varlen and qg under the lean plans; the default
# variant with the fp32 gate, bf16 g rows varlen with prefetch). Each compile takes 10-20 s on CI's two cores.
SM90_ONLY = {"varlen-qg-H2-HV4-K128", "fixed-qg-H4-HV4-K64", "gate-safe-bf16-l2norm-prefetch-8warps-varlen-H2-HV4-K128"}


def compile_cases(config_ids) -> list:
    """(config_id, target) parameters: every configuration for sm_90a, those outside SM90_ONLY for every target."""
    return [pytest.param(config_id, target, id=f"{config_id}-{target}") for config_id in config_ids for target in SM
            if target == "sm_90a" or config_id not in SM90_ONLY]

# KdaIntraConfig fields of the compiled configurations
CONFIGS = {
    "fixed-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, head_dim=128),
    "varlen-qg-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, head_dim=128, output_qg=True, varlen=True),
    "fixed-qg-H4-HV4-K64": dict(num_heads=4, num_v_heads=4, head_dim=64, output_qg=True),
    "lean-varlen-qg-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, head_dim=128, output_qg=True, varlen=True,
                                       lean_smem=True),
    "lean-unrolled-fixed-H4-HV8-K128": dict(num_heads=4, num_v_heads=8, head_dim=128, lean_smem=True,
                                            unrolled_inverse=True),
    "fused-l2norm-varlen-qg-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, head_dim=128, output_qg=True, varlen=True,
                                               lean_smem=True, unrolled_inverse=True, l2norm=True),
    "l2norm-fixed-H4-HV4-K64": dict(num_heads=4, num_v_heads=4, head_dim=64, l2norm=True),
    "lean-unrolled-8warps-varlen-qg-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, head_dim=128, output_qg=True,
                                                       varlen=True, lean_smem=True, unrolled_inverse=True, threads=256),
    "fused-l2norm-prefetch-8warps-fixed-qg-H4-HV8-K128": dict(num_heads=4, num_v_heads=8, head_dim=128,
                                                              output_qg=True, lean_smem=True, unrolled_inverse=True,
                                                              l2norm=True, prefetch=1, threads=256),
    "lean-unrolled-prefetch-varlen-qg-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, head_dim=128, output_qg=True,
                                                         varlen=True, lean_smem=True, unrolled_inverse=True,
                                                         prefetch=1),
    "fused-l2norm-prefetch-fixed-qg-H4-HV8-K128": dict(num_heads=4, num_v_heads=8, head_dim=128, output_qg=True,
                                                      lean_smem=True, unrolled_inverse=True, l2norm=True,
                                                      prefetch=1),
}
# Local-memory spill instructions (stores + reloads) the 8-warp configurations may have: capped at 128 registers so
# that two 256-thread CTAs fit on an SM, they keep some row addresses and values in local memory (L1) across the
# fill. Measured (sm_90a / sm_100a / sm_103a): 23 / 25 / 23 and 73 / 22 / 32, against some 5,400-6,000
# instructions per thread; the 4-warp configurations spill nothing. Whether the spills cost more than the extra
# warps give is for the H200 to say.
SPILLS = {"lean-unrolled-8warps-varlen-qg-H2-HV4-K128": 25, "fused-l2norm-prefetch-8warps-fixed-qg-H4-HV8-K128": 73}
# Shared memory of one SM on SM90 and SM100/SM103 (228 KB), and what each of two resident CTAs may take (the
# driver reserves 1 KB per CTA).
SMEM_PER_SM = 228 * 1024
TWO_CTA_BUDGET = SMEM_PER_SM // 2 - 1024


@pytest.mark.parametrize(("config_id", "target"), compile_cases(CONFIGS))
def test_kda_intra_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.compile_cache import compile_kernel, compile_seconds
    from cula_runtime.cute.kda.intra import KdaIntra, KdaIntraConfig
    from cula_runtime.cute.machine_code import disassemble

    config = KdaIntraConfig(**CONFIGS[config_id])
    kernel = KdaIntra(config)
    K, C = config.head_dim, config.chunk_size
    code = disassemble(compile_kernel(KdaIntra, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)
    assert compile_seconds(KdaIntra, config, target) > 0

    # Warp MMA only: 10 score blocks x (Aqk, Akk) x 2 n-atoms x K/16 k-steps, plus W and U per warp
    # (16 x K outputs, 64-deep: 4 k-steps x K/8 n-atoms each).
    # (With 8 warps each warp's code holds one of a score block's two products, and half of a W/U row band.)
    hmma = 10 * 2 * 2 * (K // 16) + 2 * 4 * (K // 8) // (config.threads // 128)
    assert code.opcodes["HMMA.16816.F32.BF16"] == hmma
    assert code.count("HMMA") == hmma
    assert code.count("HGMMA") == 0 and not [op for op in code.opcodes if op.startswith("UTC")]  # no wgmma/tcgen05
    assert code.count("LDSM") > 0  # operands through ldmatrix
    assert code.count("LDSM.16.MT88") > 0  # the W/U right-hand sides are read transposed
    assert code.count("LDL") + code.count("STL") <= SPILLS.get(config_id, 0), "register spill"

    # Global memory: q, k, v rows (16 B per access) and g rows (two 16-byte accesses per 8 fp32), once each;
    # stores: kg, w, u (and qg) rows of K, Aqk and Akk_inv rows of 64, all 16 B per access.
    # The lean plan reads k and g rows a second time, for the right-hand sides after the scores.
    passes, passes64 = kernel.passes, C * (C // 8) // kernel.num_threads
    assert code.opcodes["LDG.E.128"] == (8 if config.lean_smem else 5) * passes
    assert code.opcodes["STG.E.128"] == (3 + config.output_qg) * passes + 2 * passes64
    # scalar loads: the anchor rows of Γ (4 sub-chunk starts and the last row, 5K values over the CTA), one β,
    # and with varlen two chunk-index and two cu_seqlens entries
    anchor_loads = -(-5 * K // kernel.num_threads)
    assert code.opcodes["LDG.E"] == anchor_loads + 1 + 4 * config.varlen
    # exp2 per element: row factor, 2^Γ, 2^(Γ_last - Γ), one column factor per anchor at or after the row's
    # (the lean plan computes 2^Γ once more, in its right-hand-side pass, when qg needs it in the first)
    per_row = [3 + 4 - p * kernel.rows_per_pass // 16 for p in range(passes)]
    again = passes * config.output_qg if config.lean_smem else 0
    assert code.count("MUFU.EX2") == kernel.vec * (sum(per_row) + again)
    if config.lean_smem:  # the point of the lean plan: two CTAs per SM
        assert kernel.smem_bytes() <= TWO_CTA_BUDGET, kernel.smem_bytes()
    assert code.count("BAR.SYNC") >= 8
    # the fused L2 norm: one rsqrt per row segment of q (when read) and of k, in every pass that reads them
    reads = (2 if config.lean_smem else 1)  # k is read again by the lean plan's right-hand-side pass
    assert code.count("MUFU.RSQ") == (config.l2norm * passes * (1 + reads) if config.l2norm else 0)
    # prefetch: the second row pass's loads are issued before the first pass's kg/qg stores (without it the
    # stores come first, and the compiler may not move a load above a store to global memory)
    per_pass = 2 + (not config.lean_smem) + 2  # q, k, (v: wide plan), g as two 16-byte halves
    first = _issued_before(code.sass, "LDG.E.128", "STG.E.128")
    assert first == (1 + config.prefetch) * per_pass, (first, per_pass)
    print(f"{config_id} {target}: {compile_seconds(KdaIntra, config, target):.1f} s, {sum(code.opcodes.values())} "
          f"instructions, HMMA {code.count('HMMA')}, LDSM {code.count('LDSM')}")


def _issued_before(sass: str, op: str, stop: str) -> int:
    """How many ``op`` instructions (exact opcode) come before the first ``stop`` in the kernel's SASS."""
    count = 0
    for line in sass.splitlines():
        fields = line.split("*/", 1)[-1].split() if "/*" in line else []
        fields = [f for f in fields if not f.startswith("@")]
        if not fields:
            continue
        if fields[0] == stop:
            return count
        count += fields[0] == op
    return count


# In-kernel gate configurations (the fused-prepare path: kda_prepare's work done by the intra kernel). The last
# member is how many spill instructions (local stores + reloads) it may have: the softplus form with bf16 inputs
# needs one more register than the 255 available and spills one value (a row address, stored and reloaded once).
GATE_CONFIGS = {
    "gate-safe-l2norm-varlen-H2-HV4-K128": (dict(num_heads=2, num_v_heads=4, varlen=True, l2norm=True), {}, 0),
    "gate-softplus-bf16-neg-fixed-H2-HV4-K128": (
        dict(num_heads=2, num_v_heads=4, l2norm=True),
        dict(form="softplus", g_dtype="bfloat16", beta_dtype="bfloat16", allow_neg_eigval=True), 2),
    "gate-none-varlen-H2-HV4-K64": (
        dict(num_heads=2, num_v_heads=4, head_dim=64, varlen=True),
        dict(form="none", has_A_log=False, has_dt_bias=False, beta_sigmoid=False), 0),
    "gate-safe-bf16-l2norm-prefetch-varlen-H2-HV4-K128": (
        dict(num_heads=2, num_v_heads=4, varlen=True, l2norm=True, prefetch=1), dict(g_dtype="bfloat16"), 0),
    # 8 warps, registers capped at 128: measured 55 / 51 / 51 spill instructions on sm_90a / sm_100a / sm_103a
    "gate-safe-bf16-l2norm-prefetch-8warps-varlen-H2-HV4-K128": (
        dict(num_heads=2, num_v_heads=4, varlen=True, l2norm=True, prefetch=1, threads=256),
        dict(g_dtype="bfloat16"), 55),
    # the default variant with fp32 raw gate and β, fixed length: measured 14 / 11 / 10 spill instructions
    "gate-safe-fp32-l2norm-prefetch-8warps-fixed-H4-HV8-K128": (
        dict(num_heads=4, num_v_heads=8, l2norm=True, prefetch=1, threads=256), {}, 14),
}


@pytest.mark.parametrize(("config_id", "target"), compile_cases(GATE_CONFIGS))
def test_kda_intra_in_kernel_gate_machine_code(config_id: str, target: str) -> None:
    """The fused-prepare intra kernel: warp-MMA code as the others, two CTAs per SM, and the traffic of kda_prepare
    folded in: raw gate and β read once (scalar loads, one per element), no 16-byte g_cum rows, and the decay row
    stored once per chunk."""
    from cula_runtime.cute.compile_cache import compile_kernel
    from cula_runtime.cute.kda.intra import InKernelGate, KdaIntra, KdaIntraConfig
    from cula_runtime.cute.kda.prepare import gate_scan_segments
    from cula_runtime.cute.machine_code import disassemble

    fields, gate_fields, spills = GATE_CONFIGS[config_id]
    gate = InKernelGate(**gate_fields)
    config = KdaIntraConfig(**fields, output_qg=True, lean_smem=True, unrolled_inverse=True, gate=gate,
                            output_akk_inv=False)  # as chunk_kda_fwd_intra_from_raw builds it
    kernel = KdaIntra(config)
    K, C = config.head_dim, config.chunk_size
    code = disassemble(compile_kernel(KdaIntra, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)
    hmma = 10 * 2 * 2 * (K // 16) + 2 * 4 * (K // 8) // (config.threads // 128)
    assert code.count("HMMA") == code.opcodes["HMMA.16816.F32.BF16"] == hmma
    assert code.count("HGMMA") == 0 and not [op for op in code.opcodes if op.startswith("UTC")]
    assert code.count("LDL") + code.count("STL") <= spills, "register spill"
    assert kernel.smem_bytes() <= TWO_CTA_BUDGET, kernel.smem_bytes()  # the staging tile lives in sA's bytes

    passes = kernel.passes
    assert code.opcodes["LDG.E.128"] == 4 * passes  # q, k rows, then k, v rows for the right-hand sides: no g rows
    # one scalar gate load per (stage, row of the thread's run): C * K / 128 per thread; β once
    g_op, beta_op = ("LDG.E.U16" if d == "bfloat16" else "LDG.E" for d in (gate.g_dtype, gate.beta_dtype))
    per_thread = C * K // kernel.num_threads
    stages = K // (kernel.num_threads // gate_scan_segments(K, C))
    scalar = {"LDG.E": 4 * config.varlen + gate.has_A_log + stages * gate.has_dt_bias}
    scalar[g_op] = scalar.get(g_op, 0) + per_thread
    scalar[beta_op] = scalar.get(beta_op, 0) + 1
    for op, count in scalar.items():
        assert code.opcodes[op] == count, (op, code.opcodes[op], count)
    assert code.opcodes["STG.E"] == per_thread  # g_last: one predicated store per element the thread scans
    # kg, qg, w, u rows of K and Aqk rows of 64 (no Akk_inv: the recurrence does not read it), 16 bytes per access
    assert code.opcodes["STG.E.128"] == 4 * passes + C * (C // 8) // kernel.num_threads
    if config.l2norm:  # one rsqrt per row segment of q, k, and k again (right-hand sides)
        assert code.count("MUFU.RSQ") >= 3 * passes
    else:
        assert code.count("MUFU.RSQ") == 0
    # prefetch: the next column stage's raw gate is loaded before this stage's barrier, and the second row pass's
    # q/k rows before the first pass's kg/qg stores; β's load is issued at the kernel's start (KdaIntra.load_beta),
    # so with a bf16 β beside a bf16 gate one more load of that opcode comes before the first barrier
    ahead = 1 + config.prefetch  # (the gate's column stages go at most one ahead: prefetch 1 here)
    if g_op == "LDG.E.U16":  # (an fp32 gate shares its opcode with other scalar loads)
        early = ahead * (C // gate_scan_segments(K, C)) + (beta_op == g_op)
        assert _issued_before(code.sass, g_op, "BAR.SYNC.DEFER_BLOCKING") == early
    assert _issued_before(code.sass, "LDG.E.128", "STG.E.128") == ahead * 2  # q and k rows per pass
    print(f"{config_id} {target}: {sum(code.opcodes.values())} instructions, spills {code.count('STL')}")


def test_one_binary_serves_every_length() -> None:
    """Every extent of every tensor argument is symbolic; a second request for the same config is a cache hit."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.intra import KdaIntra, KdaIntraConfig

    config = KdaIntraConfig(num_heads=2, num_v_heads=4, head_dim=64, varlen=True)
    for spec in KdaIntra(config).argument_specs():
        if spec is not None:
            fake = spec.fake()
            assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)
    compile_cache.clear_cache()
    first = compile_cache.compile_kernel(KdaIntra, config, target="sm_90a")
    assert compile_cache.compile_kernel(KdaIntra, config, target="sm_90a") is first
    assert compile_cache.cache_info() == compile_cache.CacheInfo(hits=1, misses=1, size=1)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_dim": 96}, "64 or 128"),
        ({"head_dim": 256}, "64 or 128"),
        ({"chunk_size": 32}, "only 64"),
        ({"num_v_heads": 3}, "multiple"),
        ({"prefetch": 2}, "0 or 1"),
    ],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.kda.intra import KdaIntra, KdaIntraConfig

    config = dataclasses.replace(KdaIntraConfig(num_heads=2, num_v_heads=4), **changes)
    ok, why = KdaIntra.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        KdaIntra(config)


@pytest.mark.parametrize(
    ("phases", "gate_fields", "reason"),
    [
        ("scores", {}, "phases='all' only"),
        ("all", {"form": "exp"}, "gate.form='exp'"),
        ("all", {"g_dtype": "float16"}, "gate.g_dtype='float16'"),
        ("all", {"form": "softplus", "has_A_log": False}, "needs A_log"),
        ("all", {"form": "none"}, "only used by an activated gate"),
        ("all", {"beta_sigmoid": False, "allow_neg_eigval": True}, "requires beta_sigmoid"),
    ],
)
def test_in_kernel_gate_refusals_say_why(phases: str, gate_fields: dict, reason: str) -> None:
    from cula_runtime.cute.kda.intra import InKernelGate, KdaIntra, KdaIntraConfig

    config = KdaIntraConfig(num_heads=2, num_v_heads=4, phases=phases, gate=InKernelGate(**gate_fields))
    ok, why = KdaIntra.can_implement(config)
    assert not ok and reason in why, why


def test_wrapper_refuses_what_it_does_not_implement() -> None:
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra

    B, T, H, K = 1, 8, 1, 64
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    args = (q, q, q, torch.zeros(B, T, H, K), torch.zeros(B, T, H), 1.0)
    with pytest.raises(ValueError, match="not implemented"):
        chunk_kda_fwd_intra(*args, use_tf32_inverse=True)
    with pytest.raises(ValueError, match="CUDA"):
        chunk_kda_fwd_intra(*args)  # CPU tensors
    with pytest.raises(ValueError, match="v must be"):
        chunk_kda_fwd_intra(q, q, q[..., :32], *args[3:])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_smem_plans(head_dim: int) -> None:
    """The wide plan (verified on the H200) needs one SM per CTA at K = 128; the lean plan fits two at both K, and
    its phase-shared regions hold every buffer that lives in them."""
    from cula_runtime.cute.kda.intra import NUM_SUB, SUB, KdaIntra, KdaIntraConfig

    wide = KdaIntra(KdaIntraConfig(num_heads=1, num_v_heads=1, head_dim=head_dim))
    lean = KdaIntra(KdaIntraConfig(num_heads=1, num_v_heads=1, head_dim=head_dim, lean_smem=True))
    assert lean.smem_bytes() <= TWO_CTA_BUDGET < wide.smem_bytes() or head_dim == 64
    assert lean.smem_bytes() < wide.smem_bytes()
    C, K = 64, head_dim
    plan = lean.lean_plan()
    kh_end = plan["kh"][-1] + SUB * NUM_SUB * K * 2
    assert kh_end <= plan["reuse"]  # the four k̂ tiles
    assert plan["s"] >= C * C * 4 and plan["tb"] >= plan["s"] + SUB * C * 4  # Tinv fp32, then its temporaries
    assert plan["tb"] >= 2 * C * K * 2 and plan["tb"] + C * C * 2 <= plan["reuse"]  # w, u staged below bf16(Tinv)
    assert all(offset % 1024 == 0 for offset in (*plan["kh"], plan["s"], plan["tb"], C * K * 2))


def test_variant_knob(monkeypatch) -> None:
    """``variant=`` and ``CULA_CUTE_INTRA`` pick the intra variant; the default is ``fused-prepare-prefetch-8warps``
    (the fastest on the H200, the same bits as the lean-unrolled pipeline); an unknown name is a ValueError that
    names the knob and the choices."""
    from cula_runtime.cute.kda.intra import ENV_VARIANT, VARIANTS, variant_flags

    monkeypatch.delenv(ENV_VARIANT, raising=False)
    assert variant_flags(None) == (True, True, True, True, 1, 256) == VARIANTS["fused-prepare-prefetch-8warps"]
    monkeypatch.setenv(ENV_VARIANT, "wide")
    assert variant_flags(None) == (False, False, False, False, 0, 128)
    assert variant_flags("lean") == (True, False, False, False, 0, 128)  # the argument wins over the environment
    assert variant_flags("fused") == (True, True, True, False, 0, 128)
    assert variant_flags("fused-prepare") == (True, True, True, True, 0, 128)
    for name in ("lean-unrolled", "fused", "fused-prepare"):  # each with its loads issued one row pass ahead
        assert variant_flags(f"{name}-prefetch") == (*VARIANTS[name][:4], 1, 128)
    for name in ("lean-unrolled", "lean-unrolled-prefetch", "fused-prefetch", "fused-prepare-prefetch"):  # 8 warps
        assert variant_flags(f"{name}-8warps") == (*VARIANTS[name][:5], 256)
    monkeypatch.setenv(ENV_VARIANT, "fast")
    with pytest.raises(ValueError, match=r"CULA_CUTE_INTRA='fast'.*lean"):
        variant_flags(None)
    with pytest.raises(ValueError, match=r"variant='tf32'"):
        variant_flags("tf32")


def test_default_variant_runs_4_warps_at_k64(monkeypatch) -> None:
    """The intra primitives take K = 64 too, where 8 warps are not implemented: with nothing named, the default
    variant runs there with 4 warps (the same bits); a named 8-warp variant at K = 64 stays an error, at planning."""
    from cula_runtime.cute.kda.intra import ENV_VARIANT, VARIANTS, _plan, _primitive_flags, kernel_flags

    monkeypatch.delenv(ENV_VARIANT, raising=False)
    default = VARIANTS["fused-prepare-prefetch-8warps"]
    assert _primitive_flags(None, 128) == default
    assert _primitive_flags(None, 64) == (*default[:5], 128)
    assert _primitive_flags("lean-unrolled-8warps", 64) == VARIANTS["lean-unrolled-8warps"]
    monkeypatch.setenv(ENV_VARIANT, "lean-unrolled-8warps")
    assert _primitive_flags(None, 64)[5] == 256
    with pytest.raises(ValueError, match=r"threads=256 is implemented for .*K = 128"):
        _plan(2, 2, 64, True, False, kernel_flags(_primitive_flags(None, 64)))


MODULAR = {
    "scores-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, phases="scores"),
    "inverse-varlen-HV4": dict(num_heads=4, num_v_heads=4, phases="inverse", varlen=True),
    "inverse-unrolled-HV4": dict(num_heads=4, num_v_heads=4, phases="inverse", unrolled_inverse=True),
    "wu-varlen-qg-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, phases="wu", output_qg=True, varlen=True),
    "wu-H2-HV4-K64": dict(num_heads=2, num_v_heads=4, phases="wu", head_dim=64),
}


@pytest.mark.parametrize("target", list(SM))
@pytest.mark.parametrize("config_id", list(MODULAR))
def test_modular_step_machine_code(config_id: str, target: str) -> None:
    """Each modular step compiles to warp-MMA code without spills, moving exactly its own inputs and outputs."""
    from cula_runtime.cute.compile_cache import compile_kernel
    from cula_runtime.cute.kda.intra import KdaIntra, KdaIntraConfig
    from cula_runtime.cute.machine_code import disassemble

    config = KdaIntraConfig(**MODULAR[config_id])
    kernel = KdaIntra(config)
    code = disassemble(compile_kernel(KdaIntra, config, target=target))
    K, C, vec = config.head_dim, config.chunk_size, kernel.vec
    passes, passes64 = kernel.passes, C * (C // 8) // kernel.num_threads
    fp32_passes = C * C // 4 // kernel.num_threads  # Akk rows, 16 bytes per access
    subs = [p * kernel.rows_per_pass // 16 for p in range(passes)]
    expected = {
        # q, k and two g accesses per pass in; Aqk and the fp32 Akk out; row factor and k̂ factors
        "scores": (10 * 2 * 2 * (K // 16), 4 * passes, passes64 + fp32_passes, vec * sum(1 + 4 - s for s in subs)),
        # Akk in (fp32), Akk_inv out
        "inverse": (0, fp32_passes, passes64, 0),
        # k, v (q) and g in, Akk_inv in; w, u, kg (qg) out; 2^Γ and 2^(Γ_last - Γ)
        "wu": (2 * 4 * (K // 8), (4 + config.output_qg) * passes + passes64, (3 + config.output_qg) * passes,
               2 * vec * passes),
    }[config.phases]
    got = (code.count("HMMA"), code.opcodes["LDG.E.128"], code.opcodes["STG.E.128"], code.count("MUFU.EX2"))
    assert got == expected
    assert code.count("LDL") == 0 and code.count("STL") == 0, "register spill"
    assert code.count("HGMMA") == 0


def test_modular_configs_are_checked() -> None:
    from cula_runtime.cute.kda.intra import KdaIntra, KdaIntraConfig

    ok, why = KdaIntra.can_implement(KdaIntraConfig(num_heads=1, num_v_heads=1, phases="solve"))
    assert not ok and "phases" in why
    ok, why = KdaIntra.can_implement(KdaIntraConfig(num_heads=1, num_v_heads=1, phases="wu", lean_smem=True))
    assert not ok and "lean_smem" in why
