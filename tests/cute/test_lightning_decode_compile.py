"""CuTeDSL compilation of the Lightning decode kernel (LightningDecode) on the CPU, for sm_90a, sm_100a and sm_103a,
and a pure-Python emulation of one token step through the kernel's own index methods.

The machine code moves the state with 16-byte global loads and stores only (8 per lane, one pass each way, no MMA of
any kind); V-first reduces over K with warp shuffles only (no shared memory, no barrier); K-first reduces over the
warp's rows with shuffles, then over the 4 warps through one shared-memory exchange and one barrier per token. The
decay is one exponential per CTA. Local-memory spills are the ones measured with the installed CuTeDSL.

Nine configurations cover the code paths: the single-token form (fixed length, T = 1: a decode step) for both
layouts and pool dtypes, with bf16 or fp16 q/k/v; and the general form (a token loop): a fixed-length K-first fp32
pool, packed sequences in a K-first fp32 pool (also compiled by the oldest CuTeDSL: ``dsl_floor``), a V-first fp32
pool, packed sequences in a V-first bf16 pool, a K-first bf16 pool with fp16 q/k/v and H = 64. Two more compile
the single-token form with K-first CTAs of whole rows (``k_first_lines`` 4 fp32, 2 bf16: steps reading at least 128
MiB of state; a named barrier per line group). Every state load of a lane is issued before its first FMA (all 8 16-byte
vectors in flight at once).

The lane → (K row, V column) mapping is the KDA decode kernel's (tests/cute/test_kda_decode_compile.py emulates it:
each element once, whole 128-byte lines per warp access, each reduction's lanes one column's 128 rows). Here the
emulation runs a whole token step per CTA in float64 from the kernel's methods (lane layout, element order, the
butterflies' masks, the K-first exchange's offsets and the lanes that write o) and checks the new state and o
against ``λ S + k vᵀ`` and ``scale · Sᵀq``; and that the lane's q/k/v loads are the rows and columns it holds.

Needs CuTeDSL and TVM-FFI (cula-runtime brings them on Linux x86_64/aarch64); skips cleanly without them.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from tests.cute.compile_helpers import (
    COMPILE_MARKS,
    assert_exchange_barriers,
    assert_measured_spills,
    assert_simt_only,
    compile_machine_code,
    compile_params,
    record_launches,
)

pytestmark = COMPILE_MARKS

# LightningDecodeConfig fields of the compiled configurations
CONFIGS = {
    "T1-kv-fp32-bf16-H8": dict(num_heads=8, single_token=True),
    "T1-vk-fp32-bf16-H8": dict(num_heads=8, single_token=True, state_v_first=True),
    "T1-kv-bf16pool-bf16-H64": dict(num_heads=64, single_token=True, state_dtype="bfloat16"),
    "T1-vk-bf16pool-fp16-H64": dict(num_heads=64, single_token=True, state_v_first=True, state_dtype="bfloat16",
                                    dtype="float16"),
    "kv-fp32-bf16-H8": dict(num_heads=8),
    "varlen-kv-fp32-bf16-H4": dict(num_heads=4, varlen=True),
    "vk-fp32-bf16-H8": dict(num_heads=8, state_v_first=True),
    "varlen-vk-bf16pool-bf16-H2": dict(num_heads=2, varlen=True, state_v_first=True, state_dtype="bfloat16"),
    "kv-bf16pool-fp16-H64": dict(num_heads=64, state_dtype="bfloat16", dtype="float16"),
    # K-first CTAs of whole rows (k_first_lines: the single-token form's configurations at >= 128 MiB of state)
    "T1-kv-fp32-bf16-H8-4lines": dict(num_heads=8, single_token=True, k_first_lines=4),
    "T1-kv-bf16pool-bf16-H64-2lines": dict(num_heads=64, single_token=True, state_dtype="bfloat16", k_first_lines=2),
}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = "varlen-kv-fp32-bf16-H4"
# Local-memory spill instructions (LDL + STL) per CuTeDSL minor version, configuration and target, as measured. The
# register caps (decode.MIN_BLOCKS_PER_SM) are the most CTAs per SM at which sm_90a spills nothing; sm_100a/sm_103a
# allocate more registers for the general form and spill at its caps (a few values around the state's loads and the
# token loop), which no GPU has timed yet; the single-token form spills nowhere.
SPILLS = {
    "4.6": {
        "T1-kv-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-vk-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-kv-bf16pool-bf16-H64": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-vk-bf16pool-fp16-H64": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "kv-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 23, "sm_103a": 23},
        "varlen-kv-fp32-bf16-H4": {"sm_90a": 0, "sm_100a": 34, "sm_103a": 34},
        "vk-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 27, "sm_103a": 27},
        "varlen-vk-bf16pool-bf16-H2": {"sm_90a": 0, "sm_100a": 71, "sm_103a": 71},
        "kv-bf16pool-fp16-H64": {"sm_90a": 0, "sm_100a": 62, "sm_103a": 62},
        "T1-kv-fp32-bf16-H8-4lines": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-kv-bf16pool-bf16-H64-2lines": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
    },
    "4.8": {
        "T1-kv-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-vk-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-kv-bf16pool-bf16-H64": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-vk-bf16pool-fp16-H64": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "kv-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 21, "sm_103a": 21},
        "varlen-kv-fp32-bf16-H4": {"sm_90a": 0, "sm_100a": 34, "sm_103a": 34},
        "vk-fp32-bf16-H8": {"sm_90a": 0, "sm_100a": 27, "sm_103a": 27},
        "varlen-vk-bf16pool-bf16-H2": {"sm_90a": 0, "sm_100a": 71, "sm_103a": 71},
        "kv-bf16pool-fp16-H64": {"sm_90a": 0, "sm_100a": 62, "sm_103a": 62},
        "T1-kv-fp32-bf16-H8-4lines": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
        "T1-kv-bf16pool-bf16-H64-2lines": {"sm_90a": 0, "sm_100a": 0, "sm_103a": 0},
    },
}
K = 128


def _config(config_id: str, **changes):
    from cula_runtime.cute.lightning.decode import LightningDecodeConfig

    return LightningDecodeConfig(**{**CONFIGS[config_id], **changes})


@pytest.mark.parametrize(("config_id", "target"), compile_params(CONFIGS, DSL_FLOOR))
def test_lightning_decode_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.lightning.decode import LightningDecode

    config = _config(config_id)
    kernel = LightningDecode(config)
    code = compile_machine_code(LightningDecode, config, target)

    # SIMT only: no MMA of any flavour
    assert_simt_only(code)
    # The token step is in the code twice (the peeled first token and the token loop), once in the single-token form.
    steps = 1 if config.single_token else 2
    VC, VEC = kernel.cols, kernel.vec
    k_first = not config.state_v_first
    if k_first:
        # the warps' exchange, per token step: row group 0 of each warp writes its VC sums (VC / 4 16-byte pieces),
        # one barrier, each line group's first warp reads its columns' sums of the group's 4 warps
        pieces = VC // 4
        assert code.opcodes["STS.128"] == steps * pieces
        assert code.opcodes["LDS.128"] == steps * 4 * pieces
        assert code.count("BAR") == steps and code.opcodes["BAR.SYNC.DEFER_BLOCKING"] == steps
        assert_exchange_barriers(code, config.k_first_lines)
        assert not [op for op in code.opcodes if op.startswith(("LDS", "STS")) and op not in ("LDS.128", "STS.128")]
    else:  # the reduction over K stays in a warp: no shared memory, no barrier
        for prefix in ("LDS", "STS", "BAR"):
            assert code.count(prefix) == 0, prefix
    # Global loads: the state's 8 16-byte vectors per lane, once; per token step q and k (one 16-byte vector of
    # the lane's 8 contiguous rows each; V-first fp32 pool: two 8-byte pieces each) and v (the lane's columns:
    # 16 bytes with a bf16 pool's 8, 8 bytes with an fp32 pool's 4); scalar loads: the slot, g_gamma[h] and (packed
    # sequences) the two cu_seqlens bounds.
    qk_pieces = 4 if (config.state_v_first and VEC == 4) else 0
    per_step = (2 if qk_pieces == 0 else qk_pieces) + 1  # q and k, then v
    assert code.opcodes["LDG.E.128"] == 8 + steps * ((2 if qk_pieces == 0 else 0) + (1 if VC == 8 else 0))
    assert code.opcodes["LDG.E.64"] == steps * (qk_pieces + (1 if VC == 4 else 0))
    # ... and token 0's inputs and all 8 state vectors are issued before the first FMA of the state (the decay's
    # exponential has FMAs with immediates; the state's take three registers)
    lines = code.sass.splitlines()
    first_fma = next(i for i, line in enumerate(lines) if re.search(r"\bFFMA2? R\d+, R\d+(\.reuse)?, R\d+", line))
    early = sum(1 for line in lines[:first_fma] if re.search(r"\bLDG\.E\.(128|64)\b", line))
    assert early == 8 + per_step, f"{early} vector loads before the first FMA, not the 8 of the state + {per_step}"
    assert code.opcodes["LDG.E"] == 2 + (2 if config.varlen else 0)
    # Stores: the state's 8 vectors, once; o, one store per token (8 bytes for 4 columns, 16 for 8) in the padding
    # row's zero loop and the two copies of the token step
    o_store = "STG.E.64" if VC == 4 else "STG.E.128"
    o_stores = 1 + steps
    assert code.opcodes["STG.E.128"] == 8 + (o_stores if o_store == "STG.E.128" else 0)
    assert code.opcodes[o_store] == o_stores + (8 if o_store == "STG.E.128" else 0)
    assert not any(op.startswith("STG") and op not in ("STG.E.128", "STG.E.64") for op in code.opcodes), \
        "every store is a vector (state 16 bytes, o 8 or 16 bytes)"
    # shfl.bfly all-reduces of the lane's VC sums, per token step: V-first 4 steps over its column group's 16
    # lanes, K-first 2 steps over the warp's 4 row groups
    assert code.opcodes["SHFL.BFLY"] == steps * VC * (2 if k_first else 4)
    assert code.count("MUFU.EX2") == 1  # λ = exp(g_gamma[h]), once per CTA
    if target == "sm_90a":  # λ s + k v and acc + q s: two FMAs (and a product) per state element per token
        assert code.count("FFMA") >= steps * 2 * 8 * VEC
    assert_measured_spills(code, SPILLS, config_id, target)


def test_one_binary_serves_every_batch() -> None:
    """Every extent of every tensor argument is symbolic: one compilation for any B, T, N, P or cu_seqlens."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.lightning.decode import LightningDecode

    config = _config("kv-fp32-bf16-H8")
    for spec in LightningDecode(config).argument_specs():
        if spec is not None:
            assert all(spec.fake().dynamic_shapes_mask)
    compiled = compile_cache.compile_kernel(LightningDecode, config, target="sm_90a")
    assert compile_cache.compile_kernel(LightningDecode, config, target="sm_90a") is compiled


@pytest.mark.parametrize(("pool", "B", "T", "v_first", "lines"), [
    ("float32", 31, 1, False, 0),  # 124 MiB of state at H = 64: one line (0)
    ("float32", 32, 1, False, 4),  # 128 MiB: whole rows
    ("bfloat16", 63, 1, False, 0),
    ("bfloat16", 64, 1, False, 2),
    ("float32", 128, 2, False, 0),  # the general form (T > 1): one line
    ("float32", 128, 1, True, 0),  # V-first: no lines
])
def test_whole_rows_from_128_mib_of_state(pool: str, B: int, T: int, v_first: bool, lines: int) -> None:
    """The single-token form takes the KDA decode's rule (``kda.decode.k_first_lines``): a row's every line where
    a step reads at least 128 MiB of state (B · H heads), else one (0); the general form keeps one; meta tensors."""
    import torch

    from cula_runtime.cute.lightning import decode

    q = torch.empty(B, T, 64, 128, dtype=torch.bfloat16, device="meta")
    state = torch.empty(B + 2, 64, 128, 128, dtype=getattr(torch, pool), device="meta")
    config = decode._launch_config(q, state, v_first, None)[0]
    assert (config.k_first_lines, config.single_token) == (lines, T == 1)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_dim": 64}, "only K = V = 128"),
        ({"num_heads": 0}, "num_heads"),
        ({"dtype": "float32"}, "dtype"),
        ({"state_dtype": "float64"}, "state_dtype"),
        ({"min_blocks_per_sm": 33}, "min_blocks_per_sm"),
        ({"single_token": True, "varlen": True}, "single_token needs fixed-length"),
        ({"k_first_lines": 3}, "k_first_lines=3"),
        ({"state_dtype": "bfloat16", "k_first_lines": 4}, "a row's 2 lines"),
        ({"state_v_first": True, "k_first_lines": 2}, "K-first"),
    ],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.lightning.decode import LightningDecode

    config = dataclasses.replace(_config("kv-fp32-bf16-H8"), **changes)
    ok, why = LightningDecode.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        LightningDecode(config)


# ---------------------------------------------------------------------------------------------------------------
# One token step, emulated on the CPU from the kernel's index methods (nothing compiles)

# (pool dtype, V-first, K-first CTAs' lines per K row: 0 = the default; every count a K-first row allows)
LAYOUTS = [pytest.param(dtype, v_first, lines, id=f"{dtype}-{'vk' if v_first else 'kv'}" + (f"-{lines}l" * bool(lines)))
           for dtype in ("float32", "bfloat16") for v_first in (False, True)
           for lines in ((0,) if v_first else (0, 1, 2, 4) if dtype == "float32" else (0, 1, 2))]


def _kernel(state_dtype: str, v_first: bool, lines: int = 0):
    from cula_runtime.cute.lightning.decode import LightningDecode, LightningDecodeConfig

    return LightningDecode(LightningDecodeConfig(num_heads=1, state_dtype=state_dtype, state_v_first=v_first,
                                                 k_first_lines=lines))


def _xor_span(masks: tuple[int, ...]) -> list[int]:
    """Every XOR of a subset of ``masks``: the lanes a butterfly over them combines with lane 0."""
    span = [0]
    for mask in masks:
        span += [x ^ mask for x in span]
    return span


def _exchange_offset(kernel, e: int, m: int, c: int, w: int, buf: int) -> int:
    shape, stride = kernel.exchange_shape_stride()
    coord = (e, m, c, w, buf)
    assert all(0 <= x < n for x, n in zip(coord, shape, strict=True))
    return sum(x * s for x, s in zip(coord, stride, strict=True))


@pytest.mark.parametrize(("state_dtype", "v_first", "lines"), LAYOUTS)
def test_token_step_emulation(state_dtype: str, v_first: bool, lines: int) -> None:
    """A token step of every CTA of one head, lane by lane: ``s ← λ s + k_i v_j`` on the elements the lane holds,
    its partial sums ``Σ_i q_i s_ij``, the butterflies over ``reduce_masks``, (K-first) the exchange through its
    shared-memory offsets in warp order over each line group's 4 warps, and o from the lanes that store it. The
    result is the new state ``λ S + k vᵀ`` (every element written once) and ``o = scale · Sᵀq`` (every column
    written once)."""
    kernel = _kernel(state_dtype, v_first, lines)
    lanes = kernel.lanes
    rng = random.Random(f"{state_dtype}-{v_first}")
    S = [[rng.uniform(-1, 1) for _ in range(K)] for _ in range(K)]  # [K, V]
    q, k, v = ([rng.uniform(-1, 1) for _ in range(K)] for _ in range(3))
    decay, scale = 0.75, 0.3
    new_S: dict[tuple[int, int], float] = {}
    o: dict[int, float] = {}
    VC, NW = kernel.cols, kernel.num_warps
    for vb in range(kernel.v_blocks):
        sums: dict[tuple[int, int], list[float]] = {}
        cols: dict[tuple[int, int], int] = {}
        for warp in range(NW):
            for lane in range(32):
                _, col0, bases = lanes.lane_layout(warp, lane, vb)
                assert col0 % VC == 0, "v and o are one aligned piece of VC columns"
                if not (v_first and kernel.vec == 4):  # q and k rows: one 8-row piece, (e, p) flat
                    assert bases[1] == bases[0] + 4 and bases[0] % 8 == 0
                part = [0.0] * VC
                for p in range(8):
                    for e in range(kernel.vec):
                        i, j = lanes.element(e, p)
                        row, col = lanes.row(i, bases), col0 + j
                        assert row == bases[i // 4] + i % 4  # the q/k fragment's (i % 4, i // 4)
                        s = decay * S[row][col] + k[row] * v[col]
                        assert (row, col) not in new_S, "an element held twice"
                        new_S[(row, col)] = s
                        part[j] += q[row] * s
                sums[(warp, lane)] = part
                cols[(warp, lane)] = col0
        for warp in range(NW):  # the butterflies: each lane adds the partials of its XOR span (same columns)
            reduced = {}
            for lane in range(32):
                span = [lane ^ x for x in _xor_span(lanes.reduce_masks)]
                assert all(cols[(warp, other)] == cols[(warp, lane)] for other in span)
                reduced[lane] = [sum(sums[(warp, other)][j] for other in span) for j in range(VC)]
            for lane in range(32):
                sums[(warp, lane)] = reduced[lane]
        if v_first:
            for warp in range(NW):
                for lane in range(32):
                    r, col0, _ = lanes.lane_layout(warp, lane, vb)
                    if lanes.stores_o(r, 32 * warp + lane):
                        for j in range(VC):
                            assert col0 + j not in o, "o written twice"
                            o[col0 + j] = scale * sums[(warp, lane)][j]
        else:
            smem: dict[int, float] = {}
            buf = vb % 2  # either parity buffer
            for warp in range(NW):
                for lane in range(8):  # row group 0 publishes
                    for j in range(VC):
                        slot = _exchange_offset(kernel, j % 4, j // 4, lane, warp, buf)
                        assert slot not in smem
                        smem[slot] = sums[(warp, lane)][j]
            for warp in range(NW):  # each warp gathers its line group's 4 warps in order; lanes stores_o store
                first = lanes.exchange_warps(warp)
                for lane in range(32):
                    r, col0, _ = lanes.lane_layout(warp, lane, vb)
                    assert all(lanes.lane_layout(first + w, lane % 8, vb)[1] == col0 for w in range(4))
                    total = [sum(smem[_exchange_offset(kernel, j % 4, j // 4, lane % 8, first + w, buf)]
                                 for w in range(4)) for j in range(VC)]
                    if lanes.stores_o(r, 32 * warp + lane):
                        for j in range(VC):
                            assert col0 + j not in o, "o written twice"
                            o[col0 + j] = scale * total[j]
    assert len(new_S) == K * K
    for (row, col), s in new_S.items():
        assert s == pytest.approx(decay * S[row][col] + k[row] * v[col], abs=1e-12)
    assert sorted(o) == list(range(K))
    for col in range(K):
        expected = scale * sum(q[row] * (decay * S[row][col] + k[row] * v[col]) for row in range(K))
        assert o[col] == pytest.approx(expected, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize(("state_dtype", "lines"), [("float32", 0), ("float32", 2), ("float32", 4), ("bfloat16", 0),
                                                    ("bfloat16", 2)])
def test_exchange_buffers(state_dtype: str, lines: int) -> None:
    """K-first exchange: the writers' slots are distinct and fill the buffer exactly, the two token-parity buffers
    are disjoint, and piece m of the 8 column groups of one warp is 128 contiguous bytes (one wavefront)."""
    kernel = _kernel(state_dtype, False, lines)
    VC, NW = kernel.cols, kernel.num_warps
    slots = {_exchange_offset(kernel, e, m, c, w, buf)
             for e in range(4) for m in range(VC // 4) for c in range(8) for w in range(NW) for buf in range(2)}
    assert slots == set(range(2 * NW * 8 * VC))
    for buf in range(2):
        for w in range(NW):
            for m in range(VC // 4):
                piece = sorted(_exchange_offset(kernel, e, m, c, w, buf) for c in range(8) for e in range(4))
                assert piece == list(range(piece[0], piece[0] + 32)) and piece[0] % 32 == 0


# ---------------------------------------------------------------------------------------------------------------
# The backend's answers, on a stand-in for validated arguments (CPU tensors, a CUDA device and an sm_90 capability
# pretended: verify reads only dtypes, shapes, strides and pointers)

def _stand_in_args(**changes):
    import types

    import torch

    B, T, H = 2, 1, 4
    fields = dict(q=torch.zeros(B, T, H, K, dtype=torch.bfloat16), g_gamma=torch.zeros(H),
                  state=torch.zeros(3, H, K, K), state_indices=torch.zeros(B, dtype=torch.int32), cu_seqlens=None,
                  out=None, state_v_first=False, scale=K**-0.5, B=B, T=T, H=H, K=K, V=K, N=B,
                  device=torch.device("cuda", 0))
    fields.update(changes)
    fields.setdefault("k", fields["q"])
    fields.setdefault("v", fields["q"])
    return types.SimpleNamespace(**fields)


def _declines(monkeypatch, capability=(9, 0), **changes) -> str:
    from cula_runtime.cute.lightning import decode_backend

    monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device: capability)
    ok, reason = decode_backend.verify_lightning_decode(_stand_in_args(**changes))
    assert not ok
    assert decode_backend.plan_lightning_decode(_stand_in_args(**changes)) is None
    return reason


def test_verify_accepts_the_served_forms(monkeypatch) -> None:
    import torch

    from cula_runtime.cute.lightning import decode_backend

    for capability in ((9, 0), (10, 0), (10, 3)):
        monkeypatch.setattr("cula_runtime.cute.device_capability", lambda device, c=capability: c)
        for q_dtype in (torch.bfloat16, torch.float16):
            for state in (torch.zeros(3, 4, K, K), torch.zeros(3, 4, K, K, dtype=torch.bfloat16),
                          torch.zeros(3, 5, K, K)[:, 1:]):  # a slot stride of 5 heads: free
                q = torch.zeros(2, 1, 4, K, dtype=q_dtype)
                for cu in (None, torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1])):
                    args = _stand_in_args(q=q, state=state, cu_seqlens=cu, out=torch.empty_like(q))
                    assert decode_backend.verify_lightning_decode(args) == (
                        True, "the CuTeDSL Lightning decode kernel serves this call")
    # (a misaligned out is the kernel's to refuse, with a ValueError, as kda_decode's is: never the reference's)
    odd = torch.zeros(2 * 4 * K + 1, dtype=torch.bfloat16)[1:].view(2, 1, 4, K)  # 2-byte aligned
    assert decode_backend.verify_lightning_decode(_stand_in_args(out=odd))[0]


def test_verify_declines_with_reasons(monkeypatch) -> None:
    import torch

    assert "CUDA tensors" in _declines(monkeypatch, device=torch.device("cpu"))
    assert "this GPU is sm_120" in _declines(monkeypatch, capability=(12, 0))
    assert "sm_80" in _declines(monkeypatch, capability=(8, 0))
    f32 = torch.zeros(2, 1, 4, K)
    assert _declines(monkeypatch, q=f32) == "needs bf16 or fp16 q/k/v, got torch.float32"
    assert "K = V = 128, got K=64 V=128" in _declines(monkeypatch, K=64)
    assert "K = V = 128, got K=128 V=64" in _declines(monkeypatch, V=64)
    assert "g_gamma fp32" in _declines(monkeypatch, g_gamma=torch.zeros(4, dtype=torch.float64))
    assert "state_indices int32" in _declines(monkeypatch, state_indices=torch.zeros(2, dtype=torch.int64))
    assert "cu_seqlens int32 or int64" in _declines(monkeypatch, cu_seqlens=torch.zeros(2, dtype=torch.int16))
    assert "fp32 or bf16 state pool, got torch.float64" in _declines(
        monkeypatch, state=torch.zeros(3, 4, K, K, dtype=torch.float64))
    assert "dense [128, 128] block" in _declines(monkeypatch, state=torch.zeros(3, 4, K, 2 * K)[..., :K])
    assert "dense [128, 128] block" in _declines(monkeypatch, state=torch.zeros(3 * 4 * K * K + 1)[1:].view(
        3, 4, K, K))  # 4-byte aligned


# ---------------------------------------------------------------------------------------------------------------
# The host wrapper, the backend and the plan on the CPU: compile_kernel replaced by a recorder (nothing compiles or
# runs); compile_cache.launch and bound_launch themselves run

@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every launch as ``(kernel class, config, arguments)``."""
    return record_launches(monkeypatch)


def _validated_cpu(cu=None, *, dtype=None, pool_dtype=None, v_first=False, scale=None, T=1, out=False):
    import torch

    from cula_runtime.lightning_args import validate_lightning_decode

    dtype = dtype or torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    B, T = (3, T) if cu is None else (1, int(cu[-1]))
    N = B if cu is None else len(cu) - 1
    H = 4
    q, k, v = (torch.randn(B, T, H, K, generator=gen).to(dtype) for _ in range(3))
    pool = torch.randn(N + 2, H, K, K, generator=gen).to(pool_dtype or torch.float32)
    idx = torch.tensor([N + 1 - n if n % 2 == 0 else -1 for n in range(N)], dtype=torch.int32)
    return validate_lightning_decode(q, k, v, -torch.rand(H, generator=gen), scale=scale, state=pool,
                                     state_indices=idx, state_v_first=v_first, cu_seqlens=cu,
                                     out=torch.empty_like(q) if out else None)


@pytest.mark.parametrize("cu_dtype", ["int32", "int64", None])
@pytest.mark.parametrize(("io", "pool", "v_first"), [("bfloat16", "float32", False), ("float16", "bfloat16", True)])
def test_backend_hands_the_kernel_the_pool_itself(cu_dtype, io: str, pool: str, v_first: bool, launches) -> None:
    import torch

    from cula_runtime.cute.lightning.decode import LightningDecode
    from cula_runtime.cute.lightning.decode_backend import lightning_decode_cutedsl_backend

    cu = None if cu_dtype is None else torch.tensor([0, 1, 1, 4], dtype=getattr(torch, cu_dtype))
    args = _validated_cpu(cu, dtype=getattr(torch, io), pool_dtype=getattr(torch, pool), v_first=v_first)
    o = lightning_decode_cutedsl_backend(args)
    assert o.shape == (args.B, args.T, args.H, K) and o.dtype == args.q.dtype
    [(kernel_cls, config, call)] = launches
    assert kernel_cls is LightningDecode
    assert (config.num_heads, config.dtype, config.state_dtype, config.state_v_first, config.varlen) == (
        4, io, pool, v_first, cu is not None)
    assert config.single_token == (cu is None), "a fixed-length call of T = 1 takes the single-token form"
    q, k, v, g_gamma, state, idx, cu_arg, out, scale = call
    assert q is args.q and k is args.k and v is args.v and g_gamma is args.g_gamma
    assert state is args.state, "the pool is written in place: never a copy"
    assert idx is args.state_indices and out is o
    assert scale == pytest.approx(K**-0.5)
    if cu is None:
        assert cu_arg is None
    else:
        assert cu_arg.dtype == torch.int32 and cu_arg.tolist() == cu.tolist()
        assert (cu_arg is args.cu_seqlens) == (cu_dtype == "int32"), "int32 passed as it is, int64 narrowed"


def test_out_and_scale_pass_through_and_empty_calls_launch_nothing(launches) -> None:
    import torch

    from cula_runtime.cute.lightning.decode import lightning_decode_cutedsl
    from cula_runtime.cute.lightning.decode_backend import lightning_decode_cutedsl_backend

    args = _validated_cpu(scale=0.5, out=True)
    assert lightning_decode_cutedsl_backend(args) is args.out
    assert launches[-1][2][7] is args.out and launches[-1][2][8] == 0.5
    assert not launches[-1][1].single_token or args.T == 1
    lightning_decode_cutedsl_backend(_validated_cpu(T=3))
    assert not launches[-1][1].single_token and not launches[-1][1].varlen, "T = 3: the general form"
    count = len(launches)
    empty = _validated_cpu(T=0)
    assert lightning_decode_cutedsl_backend(empty).shape == (3, 0, 4, K)
    no_sequences = torch.zeros(0, dtype=torch.int32)
    o = lightning_decode_cutedsl(empty.q[:0], empty.k[:0], empty.v[:0], empty.g_gamma, state=empty.state,
                                 state_indices=no_sequences)
    assert o.shape == (0, 0, 4, K) and len(launches) == count


def test_the_plan_launches_each_call_with_its_tensors(launches) -> None:
    import torch

    from cula_runtime.cute.lightning.decode import plan_lightning_decode_launch

    args = _validated_cpu(torch.tensor([0, 1, 1, 4], dtype=torch.int32), v_first=True)
    run = plan_lightning_decode_launch(args.q, args.k, args.v, args.g_gamma, state=args.state,
                                       state_indices=args.state_indices, scale=None, state_v_first=True,
                                       cu_seqlens=args.cu_seqlens)
    for _ in range(2):
        q, k, v = (t.clone() for t in (args.q, args.k, args.v))
        state, out = args.state.clone(), torch.empty_like(q)
        assert run(q, k, v, args.g_gamma, state, args.state_indices, args.cu_seqlens, out) is out
        call = launches[-1][2]
        assert call[0] is q and call[4] is state and call[7] is out and call[8] == pytest.approx(K**-0.5)
    assert len(launches) == 2


@pytest.mark.parametrize(("change", "message"), [
    ("indices", "one slot per sequence"),
    ("cu", "cu_seqlens [N + 1]"),
    ("pool", "compact [128, 128] blocks"),
    ("gamma", "g_gamma must be [H]"),
    ("head_dim", "[B, T, H, 128]"),
])
def test_the_wrapper_refuses_what_it_cannot_address(change: str, message: str, launches) -> None:
    import torch

    from cula_runtime.cute.lightning.decode import lightning_decode_cutedsl

    args = _validated_cpu()
    q, k, v, gamma, state, idx, cu = args.q, args.k, args.v, args.g_gamma, args.state, args.state_indices, None
    if change == "indices":
        idx = idx[:2]
    elif change == "cu":
        cu = torch.tensor([0, 1], dtype=torch.int32)
    elif change == "pool":
        state = torch.zeros(state.shape[0], 4, K, 2 * K)[..., :K]
    elif change == "gamma":
        gamma = gamma[:2]
    else:
        q = k = v = q[..., :64]
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        lightning_decode_cutedsl(q, k, v, gamma, state=state, state_indices=idx, cu_seqlens=cu)
    assert not launches
