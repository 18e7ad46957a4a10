"""CuTeDSL compilation of the Lightning prefill's kernels A (segment states) and B (the scan) on the CPU, for
sm_90a, sm_100a and sm_103a (issue 28; :mod:`cula_runtime.cute.lightning.chunk_states`).

Kernel A's machine code holds exactly one 64-token chunk's warp-level MMAs (per warp, 16 value rows x 128 K columns
x 64 tokens: 16 n8 tiles x 4 k16 blocks) and transposed ldmatrix loads (vᵀ: one x4 per k-block; k: 8 per k-block)
in its (not unrolled) chunk loop, cp.async tiles for the prologue and the loop, the decay's exp2, and 64 fp32
stores of the state per thread. Kernel B has no MMA and no shared memory: 16-byte state vectors (``prefetch``
segments' loads, their stores, h0/ht or an fp32 pool; 8-byte ones for a bf16 pool), one exp2 per segment. Local
memory spills are the ones measured with the installed CuTeDSL (none).

Needs CuTeDSL and TVM-FFI (cula-runtime brings them on Linux x86_64/aarch64); skips cleanly without them.
"""

from __future__ import annotations

import dataclasses

import pytest

from tests.cute.compile_helpers import COMPILE_MARKS, SM, assert_measured_spills, compile_machine_code, compile_params

pytestmark = COMPILE_MARKS
C, K = 64, 128

# LightningSegmentStatesConfig fields: both block_v, both operand dtypes
STATES_CONFIGS = {
    "A-bv128-H4-bf16": dict(num_heads=4),
    "A-bv64-H16-bf16": dict(num_heads=16, block_v=64),
    "A-bv128-H2-fp16": dict(num_heads=2, dtype="float16"),
    "A-bv128-H4-bf16-skip-last": dict(num_heads=4, skip_last=True),  # the prefill backend's: last segments skipped
}
# LightningSegmentScanConfig fields: no state, h0/ht in both layouts, the pool in both dtypes and layouts, the flags
SCAN_CONFIGS = {
    "B-H4": dict(num_heads=4),
    "B-H4-h0-ht-vk": dict(num_heads=4, has_initial_state=True, output_final_state=True, state_v_first=True),
    "B-H2-h0-kv": dict(num_heads=2, has_initial_state=True),
    "B-H2-ht-kv-prefetch4": dict(num_heads=2, output_final_state=True, prefetch=4),
    "B-pool-fp32-kv-flags": dict(num_heads=4, state_pool=True, initial_state_flags=True),
    "B-pool-fp32-vk": dict(num_heads=4, state_pool=True, state_v_first=True),
    "B-pool-bf16-vk-flags": dict(num_heads=8, state_pool=True, state_dtype="bfloat16", state_v_first=True,
                                 initial_state_flags=True),
    "B-pool-bf16-kv": dict(num_heads=8, state_pool=True, state_dtype="bfloat16"),
    # the prefill backend's: last segments' own states unread, final states of sequences without tokens only
    "B-H4-h0-ht-vk-skip-last": dict(num_heads=4, has_initial_state=True, output_final_state=True,
                                    state_v_first=True, skip_last=True),
    "B-pool-bf16-vk-flags-skip-last": dict(num_heads=8, state_pool=True, state_dtype="bfloat16", state_v_first=True,
                                           initial_state_flags=True, skip_last=True),
}
# compiled by `nox -s cute_compile_oldest` too (pytest -m "compile and dsl_floor"), for every target
DSL_FLOOR = ("A-bv128-H4-bf16", "B-pool-bf16-vk-flags")
# Local-memory spill instructions per CuTeDSL minor version, configuration and target, as measured: none.
SPILLS = {version: {config_id: dict.fromkeys(SM, 0) for config_id in {**STATES_CONFIGS, **SCAN_CONFIGS}}
          for version in ("4.6", "4.8")}

HMMA_PER_CHUNK = (K // 8) * (C // 16)  # per warp: 16 n8 tiles of K x 4 k16 token blocks
LDSM_T_PER_CHUNK = C // 16 + (K // 16) * (C // 16)  # vᵀ: one x4 per token block; k: 8 x4 per token block


def _states_config(config_id: str):
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentStatesConfig

    return LightningSegmentStatesConfig(**STATES_CONFIGS[config_id])


def _scan_config(config_id: str):
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentScanConfig

    return LightningSegmentScanConfig(**SCAN_CONFIGS[config_id])


@pytest.mark.parametrize(("config_id", "target"), compile_params(STATES_CONFIGS, DSL_FLOOR))
def test_segment_states_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentStates

    config = _states_config(config_id)
    code = compile_machine_code(LightningSegmentStates, config, target)

    mma = "HMMA.16816.F32.BF16" if config.dtype == "bfloat16" else "HMMA.16816.F32"
    assert code.opcodes[mma] == HMMA_PER_CHUNK
    assert code.count("HMMA") == HMMA_PER_CHUNK  # no other MMA flavour
    assert code.count("HGMMA") == 0 and code.count("UTCHMMA") == 0  # warp-level MMA only: one source for every SM
    assert code.opcodes["LDSM.16.MT88.4"] == LDSM_T_PER_CHUNK
    assert code.opcodes["LDSM.16.M88.4"] == 0  # both operands are read token-major, transposed
    assert_measured_spills(code, SPILLS, config_id, target)
    # 16-byte cp.async of the k tile (64 x 128) and the CTA's v columns (64 x block_v), prologue and loop
    threads = config.block_v // 16 * 32
    per_chunk = (C * K + C * config.block_v) // 8 // threads
    assert code.count("LDGSTS") == 2 * per_chunk
    assert code.count("BAR.SYNC") >= 1
    assert code.count("MUFU.EX2") >= 1  # the decay λ^(L-1-j), one per token
    # S_loc: 64 fp32 accumulators per thread, each one 4-byte store (the K-first state is V-contiguous, the
    # accumulator's pairs run along K)
    assert code.opcodes["STG.E"] == K * config.block_v // threads
    assert code.count("STG") == code.opcodes["STG.E"]  # nothing else is stored to global memory


@pytest.mark.parametrize(("config_id", "target"), compile_params(SCAN_CONFIGS, DSL_FLOOR))
def test_segment_scan_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentScan

    c = _scan_config(config_id)
    code = compile_machine_code(LightningSegmentScan, c, target, timed=False)
    assert code.count("HMMA") == 0 and code.count("HGMMA") == 0 and code.count("UTCHMMA") == 0
    assert code.count("LDSM") == 0 and code.count("LDS") == 0 and code.count("STS") == 0
    assert_measured_spills(code, SPILLS, config_id, target)
    # the lane's 4 x 4 block: 4 vectors per state. seg_state: `prefetch` segments' loads and stores per group;
    # h0 / ht / an fp32 pool: 4 more 16-byte vectors; a bf16 pool: 4 8-byte ones each way
    fp32_in = c.has_initial_state or (c.state_pool and c.state_dtype == "float32")
    fp32_out = c.output_final_state or (c.state_pool and c.state_dtype == "float32")
    assert code.opcodes["LDG.E.128"] == 4 * c.prefetch + 4 * fp32_in
    assert code.opcodes["STG.E.128"] == 4 * c.prefetch + 4 * fp32_out
    bf16_pool = c.state_pool and c.state_dtype == "bfloat16"
    assert code.opcodes["LDG.E.64"] == code.opcodes["STG.E.64"] == (4 if bf16_pool else 0)
    assert code.count("STG") == code.opcodes["STG.E.128"] + code.opcodes["STG.E.64"]  # only state vectors
    assert code.opcodes["LDG.E.U8"] == (1 if c.initial_state_flags else 0)  # the has_initial_state byte
    assert code.opcodes["MUFU.EX2"] == c.prefetch  # λ^(L_s), once per segment


def test_one_binary_serves_every_length() -> None:
    """Every extent of every tensor argument is symbolic: one compilation for any B·T, NSEG, N or P."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentScan, LightningSegmentStates

    for cls, config in ((LightningSegmentStates, _states_config("A-bv128-H4-bf16")),
                        (LightningSegmentScan, _scan_config("B-pool-bf16-vk-flags"))):
        for spec in cls(config).argument_specs():
            if spec is not None:
                fake = spec.fake()
                assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)
        compiled = compile_cache.compile_kernel(cls, config, target="sm_90a")
        assert compile_cache.compile_kernel(cls, config, target="sm_90a") is compiled


@pytest.mark.parametrize(("changes", "reason"), [
    ({"head_dim": 64}, "only K = V = 128"),
    ({"chunk_size": 32}, "only 64"),
    ({"block_v": 32}, "block_v=32: expected one of (64, 128)"),
    ({"dtype": "float32"}, "dtype='float32': expected one of"),
    ({"num_heads": 0}, "num_heads"),
    ({"num_heads": 65536}, "num_heads"),
])
def test_segment_states_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentStates

    config = dataclasses.replace(_states_config("A-bv128-H4-bf16"), **changes)
    ok, why = LightningSegmentStates.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        LightningSegmentStates(config)


@pytest.mark.parametrize(("changes", "reason"), [
    ({"head_dim": 64}, "only K = V = 128"),
    ({"num_heads": 0}, "num_heads"),
    ({"prefetch": 0}, "prefetch=0"),
    ({"prefetch": 17}, "prefetch=17"),
    ({"state_dtype": "bfloat16"}, "a bf16 state needs state_pool"),
    ({"initial_state_flags": True}, "needs state_pool"),
    ({"state_pool": True, "has_initial_state": True}, "has_initial_state and output_final_state must be False"),
    ({"state_pool": True, "output_final_state": True}, "has_initial_state and output_final_state must be False"),
    ({"state_pool": True, "state_dtype": "float16"}, "state_dtype='float16': expected one of"),
])
def test_segment_scan_can_implement_says_why(changes: dict, reason: str) -> None:
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentScan

    config = dataclasses.replace(_scan_config("B-H4"), **changes)
    ok, why = LightningSegmentScan.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        LightningSegmentScan(config)


def test_scan_lanes_cover_each_state_element_once_in_whole_sectors() -> None:
    """The scan's lane mapping (emulated on the host, as the kernel computes it): the 16 CTAs x 64 threads of a
    (sequence, head) own disjoint 4 x 4 blocks covering the 128 x 128 state once, and each warp-wide vector access
    touches whole 32-byte sectors in both layouts (K-first: 8 lanes of a row, 128 bytes; V-first: 4 lanes, 64)."""
    from cula_runtime.cute.lightning.chunk_states import LightningSegmentScan

    seen = set()
    for tile in range(LightningSegmentScan.tiles):
        for tidx in range(LightningSegmentScan.num_threads):
            warp, lane = divmod(tidx, 32)
            k0 = (tile // 2) * 16 + (lane // 8) * 4
            v0 = ((tile % 2) * LightningSegmentScan.num_warps + warp) * 32 + (lane % 8) * 4
            block = {(k0 + i, v0 + j) for i in range(4) for j in range(4)}
            assert not block & seen
            seen |= block
        for warp in range(LightningSegmentScan.num_warps):
            for i in range(4):  # vector i of every lane of the warp
                for v_first in (False, True):
                    addresses = set()
                    for lane in range(32):
                        k0 = (tile // 2) * 16 + (lane // 8) * 4
                        v0 = ((tile % 2) * LightningSegmentScan.num_warps + warp) * 32 + (lane % 8) * 4
                        first = (v0 + i) * K + k0 if v_first else (k0 + i) * K + v0
                        addresses |= {first + e for e in range(4)}  # fp32 elements
                    sectors = {a // 8 for a in addresses}  # 32 bytes: 8 fp32
                    assert len(addresses) == 32 * 4 and len(sectors) * 8 == len(addresses)
    assert len(seen) == K * K


# ---- the host wrappers' marshalling (CPU tensors, the launch recorded: nothing compiled or run) ---------------------


class _Recorder:
    def __init__(self) -> None:
        self.launches: list[tuple] = []

    def launch(self, kernel_cls, config, specs, tensors, outputs, device, *scalars) -> None:
        self.launches.append((kernel_cls, config, specs, tensors, outputs, scalars))

    def bound_launch(self, kernel_cls, config, specs, device):
        from cula_runtime.cute.lightning import chunk_states as cs

        # (a bound launch takes no outputs: a plan's refusal goes to the unplanned path, whose launch has them)
        outputs = {cs.LightningSegmentStates: cs._STATES_OUTPUTS, cs.LightningSegmentScan: cs._SCAN_OUTPUTS}[kernel_cls]
        return lambda tensors, scalars: self.launch(kernel_cls, config, specs, tensors, outputs, device, *scalars)


def _check_marshalled(kernel_cls, config, specs, tensors, outputs, expected: dict) -> None:
    """Every tensor at the position its spec names, keeping the spec's promises; None exactly where the spec is
    None; the outputs' positions; ``expected``: position -> the tensor that must be there."""
    assert specs == kernel_cls(config).argument_specs()
    assert len(tensors) == len(specs)
    for i, (spec, tensor) in enumerate(zip(specs, tensors, strict=True)):
        assert (spec is None) == (tensor is None), i
        if spec is not None:
            assert spec.conforms(tensor), i
    for i, tensor in expected.items():
        assert tensors[i] is tensor or (tensor is not None and tensors[i].data_ptr() == tensor.data_ptr()), i
    assert all(specs[i] is not None for i in outputs if tensors[i] is not None)


@pytest.mark.parametrize("planned", [False, True], ids=["launch", "bound"])
def test_segment_states_marshalling(monkeypatch: pytest.MonkeyPatch, planned: bool) -> None:
    import torch

    from cula_runtime.cute.lightning import chunk_states as cs

    rec = _Recorder()
    monkeypatch.setattr(cs, "launch", rec.launch)
    monkeypatch.setattr(cs, "bound_launch", rec.bound_launch)
    k = torch.randn(300, 3, K).bfloat16()
    v = torch.randn(300, 3, K).bfloat16()
    g = -torch.rand(3)
    segments = torch.tensor([[0, 0, 200, 0], [0, 200, 100, 0]], dtype=torch.int32)
    seg_state = torch.empty(2, 3, K, K)
    if planned:
        cs.plan_segment_states(3, torch.bfloat16, 64, torch.device("cpu"))(k, v, g, segments, seg_state)
    else:
        cs._states_run(k, v, g, segments, seg_state, 64)
    (kernel_cls, config, specs, tensors, outputs, scalars), = rec.launches
    assert kernel_cls is cs.LightningSegmentStates and scalars == ()
    # (bound: the prefill backend's form, each sequence's last segment skipped)
    assert config == cs.LightningSegmentStatesConfig(num_heads=3, block_v=64, dtype="bfloat16", skip_last=planned)
    _check_marshalled(kernel_cls, config, specs, tensors, outputs, {0: k, 1: v, 2: segments, 3: g, 4: seg_state})
    assert outputs == frozenset({4})
    rec.launches.clear()
    cs._states_run(k, v, g, segments[:0], seg_state[:0], 64)  # no segment: no launch
    assert not rec.launches


@pytest.mark.parametrize(("form", "v_first"), [("plain", False), ("h0-ht", True), ("h0", False),
                                               ("pool-fp32-flags", True), ("pool-bf16", False)])
@pytest.mark.parametrize("planned", [False, True], ids=["launch", "bound"])
def test_segment_scan_marshalling(monkeypatch: pytest.MonkeyPatch, form: str, v_first: bool, planned: bool) -> None:
    import torch

    from cula_runtime.cute.lightning import chunk_states as cs

    rec = _Recorder()
    monkeypatch.setattr(cs, "launch", rec.launch)
    monkeypatch.setattr(cs, "bound_launch", rec.bound_launch)
    N, H = 3, 2
    seg_state = torch.randn(4, H, K, K)
    segments = torch.tensor([[0, 0, 64, 0], [0, 64, 10, 0], [2, 74, 64, 0], [2, 138, 1, 0]], dtype=torch.int32)
    seq_segments = torch.tensor([0, 2, 2, 4], dtype=torch.int32)
    g = -torch.rand(H)
    h0 = torch.randn(N, H, K, K) if form.startswith("h0") else None
    ht = torch.empty(N, H, K, K) if form == "h0-ht" else None
    pool = idx = flags = None
    if form.startswith("pool"):
        pool = torch.randn(5, H, K, K).to(torch.bfloat16 if "bf16" in form else torch.float32)
        idx = torch.tensor([4, -1, 0], dtype=torch.int32)
        flags = torch.tensor([True, False, True]) if "flags" in form else None
    if planned:
        flags_key = cs.scan_flags(h0, ht is not None, v_first, pool, flags)
        cs.plan_segment_scan(H, N, flags_key, torch.device("cpu"))(seg_state, segments, seq_segments, g, h0, ht,
                                                                      pool, idx, flags)
    else:
        cs._scan_run(seg_state, segments, seq_segments, g, h0, ht, v_first, pool, idx, flags)
    (kernel_cls, config, specs, tensors, outputs, scalars), = rec.launches
    assert kernel_cls is cs.LightningSegmentScan and scalars == ()
    assert config == cs.LightningSegmentScanConfig(
        num_heads=H, has_initial_state=h0 is not None, output_final_state=ht is not None, state_v_first=v_first,
        state_pool=pool is not None, state_dtype="bfloat16" if "bf16" in form else "float32",
        initial_state_flags=flags is not None, skip_last=planned)  # (bound: the prefill backend's form)
    _check_marshalled(kernel_cls, config, specs, tensors, outputs,
                      {0: seg_state, 1: segments, 2: seq_segments, 3: g, 4: h0, 5: ht, 6: pool, 7: idx})
    if flags is not None:
        assert tensors[8].dtype == torch.uint8 and tensors[8].data_ptr() == flags.data_ptr()  # a view, no copy
    assert outputs == frozenset({0, 5, 6})
