"""CuTeDSL compilation of the KDA chunk-intra kernel on the CPU (no GPU): it builds for sm_90a, sm_100a and sm_103a,
its machine code is warp-MMA code (bf16 HMMA fed by ldmatrix, no wgmma or tcgen05), its local-memory spills are the
ones measured with the installed CuTeDSL, and the global-memory traffic is what we expect: the raw gate and β read
once, q/k/v rows in 16-byte accesses, every output written once. Skips without CuTeDSL and TVM-FFI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.cute.compile_helpers import COMPILE_MARKS, assert_measured_spills, compile_machine_code, compile_params

pytestmark = COMPILE_MARKS

# KdaIntraConfig fields and InKernelGate fields of the compiled configurations. Each compile takes 10-20 s on CI's
# two cores.
CONFIGS = {
    # the cutedsl backend's most common configuration: safe gate, fp32 g and β, L2 norm in the kernel
    "safe-fp32-l2norm-fixed-H4-HV8": (dict(num_heads=4, num_v_heads=8, l2norm=True), {}),
    # ... packed: the configuration `nox -s cute_compile_oldest` also compiles with the oldest CuTeDSL admitted
    "safe-fp32-l2norm-varlen-H2-HV4": (dict(num_heads=2, num_v_heads=4, varlen=True, l2norm=True), {}),
    # bf16 raw gate (16-bit scalar loads)
    "safe-bf16-l2norm-varlen-H2-HV4": (dict(num_heads=2, num_v_heads=4, varlen=True, l2norm=True),
                                       dict(g_dtype="bfloat16")),
    # the softplus form with bf16 g and β and 2 sigmoid(β)
    "softplus-bf16-neg-fixed-H2-HV4": (dict(num_heads=2, num_v_heads=4, l2norm=True),
                                       dict(form="softplus", g_dtype="bfloat16", beta_dtype="bfloat16",
                                            allow_neg_eigval=True)),
    # a precomputed log-gate, β as given (bf16), no L2 norm
    "none-bf16-varlen-H2-HV4": (dict(num_heads=2, num_v_heads=4, varlen=True),
                                dict(form="none", g_dtype="bfloat16", beta_dtype="bfloat16", has_A_log=False,
                                     has_dt_bias=False, beta_sigmoid=False)),
    # the unbounded form (diagonal blocks by the levels split): a precomputed fp32 Kimi-style log-gate, packed, β as
    # given (fp32), L2 norm in the kernel
    "unbounded-none-fp32-l2norm-varlen-H2-HV4": (dict(num_heads=2, num_v_heads=4, varlen=True, l2norm=True,
                                                      unbounded=True),
                                                 dict(form="none", has_A_log=False, has_dt_bias=False,
                                                      beta_sigmoid=False)),
    # ... and the in-kernel softplus gate (fp32 g, β logits)
    "unbounded-softplus-fp32-l2norm-fixed-H2-HV4": (dict(num_heads=2, num_v_heads=4, l2norm=True, unbounded=True),
                                                    dict(form="softplus")),
}
# Compiled for sm_90a only: on sm_100a and sm_103a it differs from a configuration compiled there by the gate's dtype
# alone.
SM90_ONLY = {"safe-bf16-l2norm-varlen-H2-HV4"}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = "safe-fp32-l2norm-varlen-H2-HV4"

# Local-memory spill instructions (local stores + reloads) per CuTeDSL minor version, configuration and target, as
# measured (each check is `<=` its own count). Registers are capped at 128 so that two 256-thread CTAs fit on an SM,
# so some row addresses and values live in local memory (L1) across the fill, against some 6,300-8,200 instructions
# per thread. The H200 runs that made this kernel the default used CuTeDSL 4.6.2.
SPILLS = {
    "4.6": {
        "safe-fp32-l2norm-fixed-H4-HV8": {"sm_90a": 14, "sm_100a": 11, "sm_103a": 10},
        "safe-fp32-l2norm-varlen-H2-HV4": {"sm_90a": 55, "sm_100a": 51, "sm_103a": 51},
        "safe-bf16-l2norm-varlen-H2-HV4": {"sm_90a": 55},
        "softplus-bf16-neg-fixed-H2-HV4": {"sm_90a": 14, "sm_100a": 11, "sm_103a": 10},
        "none-bf16-varlen-H2-HV4": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "unbounded-none-fp32-l2norm-varlen-H2-HV4": {"sm_90a": 6, "sm_100a": 6, "sm_103a": 6},
        "unbounded-softplus-fp32-l2norm-fixed-H2-HV4": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
    },
    "4.8": {
        "safe-fp32-l2norm-fixed-H4-HV8": {"sm_90a": 29, "sm_100a": 24, "sm_103a": 24},
        "safe-fp32-l2norm-varlen-H2-HV4": {"sm_90a": 15, "sm_100a": 18, "sm_103a": 17},
        "safe-bf16-l2norm-varlen-H2-HV4": {"sm_90a": 15},
        "softplus-bf16-neg-fixed-H2-HV4": {"sm_90a": 29, "sm_100a": 30, "sm_103a": 30},
        "none-bf16-varlen-H2-HV4": {"sm_90a": 15, "sm_100a": 6, "sm_103a": 0},
        # issue 25 item 6's leaner unbounded form (paired bf16 roundings in the levels loop, paired stores below the
        # diagonal, the ex2/lg2 softplus): fewer instructions, a few spills moved between targets (were 6/4/4 and
        # 14/0/0)
        "unbounded-none-fp32-l2norm-varlen-H2-HV4": {"sm_90a": 0, "sm_100a": 5, "sm_103a": 2},
        "unbounded-softplus-fp32-l2norm-fixed-H2-HV4": {"sm_90a": 6, "sm_100a": 9, "sm_103a": 9},
    },
}
# 4.7.1 measured the same counts as 4.6.2 (compiled here, never run on a GPU; CI compiles the two ends of the range)
SPILLS["4.7"] = SPILLS["4.6"]
# Shared memory of one SM on SM90 and SM100/SM103 (228 KB), and what each of two resident CTAs may take (the
# driver reserves 1 KB per CTA).
SMEM_PER_SM = 228 * 1024
TWO_CTA_BUDGET = SMEM_PER_SM // 2 - 1024


def compile_cases(config_ids) -> list:
    """(config_id, target) parameters: every configuration for sm_90a, those outside SM90_ONLY for every target;
    DSL_FLOOR's marked ``dsl_floor``."""
    return compile_params(config_ids, DSL_FLOOR, sm90_only=SM90_ONLY)


def _config(config_id: str):
    from cula_runtime.cute.kda.intra import InKernelGate, KdaIntraConfig

    fields, gate_fields = CONFIGS[config_id]
    return KdaIntraConfig(**fields, gate=InKernelGate(**gate_fields))


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


@pytest.mark.parametrize(("config_id", "target"), compile_cases(CONFIGS))
def test_kda_intra_machine_code(config_id: str, target: str) -> None:
    """Warp-MMA code, two CTAs per SM, the measured spills, and the traffic of one chunk: raw gate and β read once
    (scalar loads, one per element), q/k rows then k/v rows in 16-byte accesses, the decay row stored once per
    element a thread scans, and w/u/qg/kg/Aqk rows stored once in 16-byte accesses."""
    from cula_runtime.cute.compile_cache import compile_seconds
    from cula_runtime.cute.kda.gate import gate_scan_segments
    from cula_runtime.cute.kda.intra import KdaIntra

    config = _config(config_id)
    gate = config.gate
    kernel = KdaIntra(config)
    K, C, threads = config.head_dim, config.chunk_size, kernel.num_threads
    code = compile_machine_code(KdaIntra, config, target)

    # Warp MMA only: 10 score blocks x (Aqk, Akk) x 2 n-atoms x K/16 k-steps (each of the 8 warps' code holds one of a
    # block's two products), plus half of a W/U row band per warp (16 x K outputs, 64-deep: 4 k-steps x K/8 n-atoms
    # each, for W and U, over two warps). Unbounded: one code path of all 8 warps for the blocks below the diagonal
    # (a runtime loop over 16 x 8 x K products), and in the fill, per row pass (sub-chunk), one for the diagonal
    # blocks' products (16 x 8 x K each).
    hmma = 10 * 2 * 2 * (K // 16) + 2 * 4 * (K // 8) // 2
    if config.unbounded:
        hmma = (1 + kernel.passes) * (K // 16) + 2 * 4 * (K // 8) // 2
    assert code.count("HMMA") == code.opcodes["HMMA.16816.F32.BF16"] == hmma
    assert code.count("HGMMA") == 0 and not [op for op in code.opcodes if op.startswith("UTC")]  # no wgmma/tcgen05
    assert code.count("LDSM") > 0  # operands through ldmatrix
    assert code.count("LDSM.16.MT88") > 0  # the W/U right-hand sides are read transposed
    spills = assert_measured_spills(code, SPILLS, config_id, target)
    assert kernel.smem_bytes() <= TWO_CTA_BUDGET, kernel.smem_bytes()  # the staging tile lives in Tinv's bytes
    assert code.count("BAR.SYNC") >= 8

    passes = kernel.passes
    assert code.opcodes["LDG.E.128"] == 4 * passes  # q, k rows, then k, v rows for the right-hand sides: no g rows
    # one scalar gate load per (stage, row of the thread's run): C * K / 256 per thread; β once
    g_op, beta_op = ("LDG.E.U16" if d == "bfloat16" else "LDG.E" for d in (gate.g_dtype, gate.beta_dtype))
    per_thread = C * K // threads
    runs = gate_scan_segments(K, C)
    stages = K // (threads // runs)
    scalar = {"LDG.E": 4 * config.varlen + gate.has_A_log + stages * gate.has_dt_bias}
    scalar[g_op] = scalar.get(g_op, 0) + per_thread
    scalar[beta_op] = scalar.get(beta_op, 0) + 1
    for op, count in scalar.items():
        assert code.opcodes[op] == count, (op, code.opcodes[op], count)
    assert code.opcodes["STG.E"] == per_thread  # g_last: one predicated store per element the thread scans
    # kg, qg, w, u rows of K and Aqk rows of 64, 16 bytes per access
    assert code.opcodes["STG.E.128"] == 4 * passes + C * (C // 8) // threads
    # exp2 per element: the row factor, 2^Γ (qg; the right-hand sides' pass reuses it: Γ stays in registers),
    # 2^(Γ_last - Γ), one column factor per anchor at or after the row's; then exp(A_log) and β's sigmoid.
    # Unbounded: no diagonal column factor nor, in sub-chunk 0, row factor, and per row pass one factor per element
    # the thread holds in the body of the runtime loop over the diagonal blocks' 4 levels (its token's row or column
    # factor at each level); there the compiler may also make 2^Γ of a row pass again in the right-hand sides' pass
    # rather than keep it (measured: of up to one pass, 4.8 on the packed configuration).
    per_row = [3 + 4 - config.unbounded * (1 + (p == 0)) - p * kernel.rows_per_pass // 16 for p in range(passes)]
    ex2 = kernel.vec * sum(per_row) + gate.beta_sigmoid + (gate.form != "none" and gate.has_A_log)
    if config.unbounded:
        ex2 += passes * kernel.vec
    # one exp2 per gate element the thread activates (the safe form's sigmoid, the softplus's e^-|x|), and the
    # softplus one log2 per element (log1p(e) = ln 2 log2(1 + e), gate.activate_gate)
    activations = per_thread * (gate.form != "none")
    if config.unbounded:
        assert code.count("MUFU.EX2") - ex2 - activations in (0, kernel.vec)
    else:
        assert code.count("MUFU.EX2") == ex2 + activations
    assert code.count("MUFU.LG2") == per_thread * (gate.form == "softplus")
    if config.l2norm:  # one rsqrt per row segment of q, k, and k again (right-hand sides)
        assert code.count("MUFU.RSQ") >= 3 * passes
    else:
        assert code.count("MUFU.RSQ") == 0
    # The next column stage's raw gate is loaded before this stage's barrier, and the second row pass's q/k rows
    # before the first pass's kg/qg stores (the compiler may not move a load above a store to global memory); β's
    # load is issued at the kernel's start (KdaIntra.load_beta), so with a bf16 β beside a bf16 gate one more load of
    # that opcode comes before the first barrier.
    if g_op == "LDG.E.U16":  # (an fp32 gate shares its opcode with other scalar loads)
        early = 2 * (C // runs) + (beta_op == g_op)
        assert _issued_before(code.sass, g_op, "BAR.SYNC.DEFER_BLOCKING") == early
    assert _issued_before(code.sass, "LDG.E.128", "STG.E.128") == 2 * 2  # q and k rows of two passes
    print(f"{config_id} {target}: {compile_seconds(KdaIntra, config, target):.1f} s, {sum(code.opcodes.values())} "
          f"instructions, spills {spills}")


def test_every_extent_is_symbolic() -> None:
    """One binary serves every length: every extent of every tensor argument is symbolic, every stride but the
    unit last one too."""
    from cula_runtime.cute.kda.intra import KdaIntra

    for config_id in ("safe-fp32-l2norm-fixed-H4-HV8", "safe-fp32-l2norm-varlen-H2-HV4"):
        for spec in KdaIntra(_config(config_id)).argument_specs():
            if spec is not None:
                fake = spec.fake()
                assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)


@pytest.mark.parametrize(
    ("changes", "gate_fields", "reason"),
    [
        ({"head_dim": 64}, {}, "only K = V = 128"),
        ({"chunk_size": 32}, {}, "only 64"),
        ({"num_v_heads": 3}, {}, "multiple"),
        ({}, {"form": "exp"}, "gate.form='exp'"),
        ({}, {"g_dtype": "float16"}, "gate.g_dtype='float16'"),
        ({}, {"form": "softplus", "has_A_log": False}, "needs A_log"),
        ({}, {"form": "none"}, "only used by an activated gate"),
        ({}, {"beta_sigmoid": False, "allow_neg_eigval": True}, "requires beta_sigmoid"),
    ],
)
def test_can_implement_says_why(changes: dict, gate_fields: dict, reason: str) -> None:
    from cula_runtime.cute.kda.intra import InKernelGate, KdaIntra, KdaIntraConfig

    config = dataclasses.replace(KdaIntraConfig(num_heads=2, num_v_heads=4, gate=InKernelGate(**gate_fields)),
                                 **changes)
    ok, why = KdaIntra.can_implement(config)
    assert not ok and reason in why, why
    with pytest.raises(ValueError, match="cannot implement"):
        KdaIntra(config)


def test_wrapper_refuses_what_it_does_not_implement() -> None:
    from cula_runtime.cute.kda.intra import chunk_kda_fwd_intra_from_raw

    B, T, H, K = 1, 8, 1, 128
    q = torch.zeros(B, T, H, K, dtype=torch.bfloat16)
    args = (q, q, q, torch.zeros(B, T, H, K), torch.zeros(B, T, H), 1.0)
    with pytest.raises(ValueError, match="CUDA"):
        chunk_kda_fwd_intra_from_raw(*args)  # CPU tensors
    with pytest.raises(ValueError, match=r"serves K = V = 128\), got \(1, 8, 1, 64\)"):
        chunk_kda_fwd_intra_from_raw(*(x[..., :64] for x in args[:4]), *args[4:])


def test_smem_plan() -> None:
    """Two CTAs fit on an SM, and the phase-shared regions hold every buffer that lives in them."""
    from cula_runtime.cute.kda.intra import NUM_SUB, SUB, KdaIntra

    kernel = KdaIntra(_config("safe-fp32-l2norm-fixed-H4-HV8"))
    assert kernel.smem_bytes() <= TWO_CTA_BUDGET
    C, K = 64, 128
    plan = kernel.smem_plan()
    kh_end = plan["kh"][-1] + SUB * NUM_SUB * K * 2
    assert kh_end <= plan["reuse"]  # the four k̂ tiles
    assert plan["s"] >= C * C * 4 and plan["tb"] >= plan["s"] + SUB * C * 4  # Tinv fp32, then its temporaries
    width = kernel.num_threads // 4  # the gate prologue's stage: 64 columns of the chunk's rows, then 4 run totals
    assert (C + 4) * width * 4 <= plan["reuse"]
    assert plan["tb"] >= 2 * C * K * 2 and plan["tb"] + C * C * 2 <= plan["reuse"]  # w, u staged below bf16(Tinv)
    assert all(offset % 1024 == 0 for offset in (*plan["kh"], plan["s"], plan["tb"], C * K * 2))
    # the unbounded form: k̂ of anchors 1-3 only, then one sub-chunk's Γ (fp32) and the diagonal blocks' four A
    # operands (bf16) in the same region (their two B operands over sub-chunk 0's q̃ and k̃, in the rows region), and
    # each thread's two index words (2 KB)
    unbounded = KdaIntra(dataclasses.replace(_config("safe-fp32-l2norm-fixed-H4-HV8"), unbounded=True))
    uplan = unbounded.smem_plan()
    assert uplan["kh"][1:] == [0, SUB * K * 2, 3 * SUB * K * 2] and uplan["diag"] == 6 * SUB * K * 2
    assert uplan["diag_a"] == uplan["diag"] + SUB * K * 4 and uplan["diag_a"] % 1024 == 0
    assert uplan["diag_a"] + 4 * SUB * K * 2 == uplan["reuse"] == plan["reuse"] + 8 * 1024
    assert unbounded.smem_bytes() == kernel.smem_bytes() + 8 * 1024 + 2 * 1024 <= TWO_CTA_BUDGET


def test_below_diagonal_outputs_pair_adjacent_columns() -> None:
    """Traced on the host with static lane indices: in the diagonal product tile's accumulator (one m16n8k16 atom,
    16 x 8 outputs per warp), each lane's elements 2 h and 2 h + 1 are columns c and c + 1 (c even) of row r + 8 h,
    (r, c) being element 0's: ``scores_below`` stores each such pair as one bf16 (Aqk) or fp32 (Akk) pair from
    element 0's coordinates alone."""
    pytest.importorskip("cutlass", reason="CuTeDSL is not installed")
    import cutlass.cute as cute

    from cula_runtime.cute.kda.intra import SUB, KdaIntra

    seen = {}

    @cute.jit
    def probe():
        mma = KdaIntra.diag_mma()
        for lane in tuple(range(32)):
            coords = mma.get_slice(lane).partition_C(cute.make_identity_tensor((SUB, SUB // 2)))
            seen[lane] = [coords[e] for e in range(cute.size(coords))]

    probe()
    assert sorted(seen) == list(range(32))
    covered = set()
    for lane, coords in seen.items():
        coords = [(int(i), int(j)) for i, j in coords]
        (r, c), pairs = coords[0], len(coords) // 2
        assert c % 2 == 0 and coords == [(r + 8 * h, c + j) for h in range(pairs) for j in range(2)], lane
        covered.update(coords)
    assert covered == {(i, j) for i in range(SUB) for j in range(SUB // 2)}
