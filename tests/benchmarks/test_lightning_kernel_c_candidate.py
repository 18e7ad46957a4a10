"""The kernel C candidate (``benchmarks/lightning_kernel_c_candidate.py``) and its A/B script
(``benchmarks/ab_lightning_kernel_c.py``).

CPU (marked ``compile``, skipped without CuTeDSL): compiled for sm_90a, sm_100a and sm_103a, its machine code holds
the product kernel's MMAs and shared-memory traffic per chunk (every one of the score tile's blocks made once, by one
warp), one CTA barrier, the cp.async copies of one chunk in the prologue and one in the loop, no local memory (no
spill, no stack) and at most 255 registers; its shared memory fits one CTA per H200 SM; the wrapper names every bad
argument. CPU, no CuTeDSL needed: the A/B script's shape selection, floor and table.

GPU (marked ``gpu``): the candidate's outputs are the product kernel's, bit for bit, on two small shapes (random
start states, segments with gaps, partial chunks, one-token segments and segments of 8 chunks, which go round the
four stages twice).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from cula_runtime import cute as cula_cute
from tests.cute.compile_helpers import COMPILE_MARKS, SM, compile_machine_code

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ab_lightning_kernel_c as ab  # noqa: E402

needs_cutedsl = pytest.mark.skipif(
    not cula_cute.is_available(),
    reason="CuTeDSL or TVM-FFI is not installed (cula-runtime brings them on Linux x86_64/aarch64)",
)

C, K = 64, 128
THREADS = 256
# Per chunk (one CTA, 8 warps of 16 value rows): q·S 8 k-blocks x 8 token tiles, vᵀ·Pᵀ 2 x (4 + 3 + 2 + 1), the
# state 4 x 16, in every warp's code, and the score tile's 10 lower blocks (2 n8 tiles x 8 k-blocks), each in the
# code of the one warp that makes it: the product's counts at its V block 128.
HMMA_PER_CHUNK = 64 + 20 + 64 + 10 * 16
LDSM_PER_CHUNK = 32 + 10 + 10 * 8 + 8 * 8  # q, P, the score blocks' k rows and q rows (8 query blocks over 8 warps)
LDSM_T_PER_CHUNK = 32 + 4  # kᵀ, vᵀ
LDGSTS_PER_CHUNK = 3 * C * K // 8 // THREADS  # q, k, v: 16 bytes per copy
H200_SMEM_PER_CTA = 227 * 1024  # the most dynamic shared memory one CTA may have on SM90


def _candidate():
    import lightning_kernel_c_candidate as candidate

    return candidate


def _registers_and_stack(compiled) -> tuple[int, int]:
    """``(REG, STACK)`` of the compiled kernel from ``cuobjdump --dump-resource-usage`` (the wheel's, beside
    nvdisasm); skips when there is none."""
    from cula_runtime.cute.machine_code import cubin_bytes, nvdisasm_path

    tool = os.path.join(os.path.dirname(nvdisasm_path()), "cuobjdump")
    if not os.access(tool, os.X_OK):
        pytest.skip("no cuobjdump beside nvdisasm (pip install nvidia-cuda-cuobjdump)")
    with tempfile.TemporaryDirectory(prefix="cula-res-") as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin_bytes(compiled))
        text = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True,
                              check=True).stdout
    match = re.search(r"REG:(\d+)\s+STACK:(\d+)", text)
    assert match, text
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize(("heads", "target"), [
    pytest.param(heads, target, id=f"H{heads}-{target}", marks=COMPILE_MARKS)
    for heads, targets in ((64, tuple(SM)), (16, ("sm_90a",))) for target in targets
])
def test_candidate_machine_code(heads: int, target: str) -> None:
    from cula_runtime.cute.compile_cache import compile_kernel

    candidate = _candidate()
    config = candidate.candidate_config(heads)
    code = compile_machine_code(candidate.LightningChunkOutputCandidate, config, target)

    assert code.opcodes["HMMA.16816.F32.BF16"] == HMMA_PER_CHUNK
    assert code.count("HMMA") == HMMA_PER_CHUNK  # no other MMA flavour, no wgmma/tcgen05
    assert code.count("HGMMA") == 0 and code.count("UTCHMMA") == 0 and code.count("UTCQMMA") == 0
    assert code.opcodes["LDSM.16.M88.4"] == LDSM_PER_CHUNK
    assert code.opcodes["LDSM.16.MT88.4"] == LDSM_T_PER_CHUNK
    assert code.opcodes["STSM.16.MT88.4"] == 4
    assert code.count("LDGSTS") == 2 * LDGSTS_PER_CHUNK  # the prologue's loop and the chunk loop's refill
    assert code.count("BAR.SYNC") == 1  # one CTA barrier per chunk, none elsewhere
    assert code.count("MUFU.EX2") == 4  # the decay tables and λ^64, once per CTA
    assert code.count("STG") == C // 16 and code.opcodes["STG.E.128"] == C // 16  # o rows, 16 bytes per store
    assert code.count("LDL") + code.count("STL") == 0, "register spill"
    registers, stack = _registers_and_stack(compile_kernel(candidate.LightningChunkOutputCandidate, config,
                                                           target=target))
    assert stack == 0 and registers <= 255


@needs_cutedsl
def test_shared_memory_fits_one_cta_per_sm() -> None:
    candidate = _candidate()
    assert candidate.shared_memory_bytes() == 4 * 48 * 1024 + 2 * 8 * 1024 + 768 == 213_760
    assert candidate.shared_memory_bytes() + 1024 <= H200_SMEM_PER_CTA  # with the 1 KB the hardware reserves


@needs_cutedsl
@pytest.mark.parametrize(("changes", "reason"), [
    ({"block_v": 64}, "covers all 128 value columns"),
    ({"head_dim": 64}, "only K = V = 128"),
    ({"chunk_size": 32}, "only 64"),
    ({"num_heads": 0}, "num_heads"),
])
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    import dataclasses

    candidate = _candidate()
    config = dataclasses.replace(candidate.candidate_config(4), **changes)
    ok, why = candidate.LightningChunkOutputCandidate.can_implement(config)
    assert not ok and reason in why
    with pytest.raises(ValueError, match="cannot implement"):
        candidate.LightningChunkOutputCandidate(config)


def _cpu_arguments(rows: int = 200, H: int = 2) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, H, K, generator=gen).to(torch.bfloat16) for _ in range(3))
    return dict(q=q, k=k, v=v, g_gamma=torch.zeros(H), seg_state=torch.zeros(1, H, K, K),
                segments=torch.tensor([[0, 0, rows, 0]], dtype=torch.int32), o=torch.empty_like(v), scale=1.0,
                seg_len=256)


@needs_cutedsl
@pytest.mark.parametrize(("change", "error", "message"), [
    ({"q": lambda a: a["q"].tolist()}, TypeError, "q must be a torch.Tensor"),
    ({"k": lambda a: a["k"][:-1]}, ValueError, "k must be bfloat16"),
    ({"v": lambda a: a["v"].transpose(0, 1).contiguous().transpose(0, 1)}, ValueError, "v must be contiguous"),
    ({"q": lambda a: a["q"].as_strided(a["q"].shape, (K, 200 * K, 1))}, ValueError, "q must be contiguous"),
    ({"o": lambda a: a["o"].float()}, ValueError, "o must be bfloat16"),
    ({"g_gamma": lambda a: a["g_gamma"].double()}, ValueError, "g_gamma must be contiguous float32"),
    ({"segments": lambda a: a["segments"].long()}, ValueError, "segments must be contiguous int32"),
    ({"seg_state": lambda a: a["seg_state"][:, :, :, :64]}, ValueError, "seg_state must be contiguous float32"),
    ({"scale": lambda a: float("inf")}, TypeError, "scale must be a finite real number"),
    ({"seg_len": lambda a: 100}, ValueError, "seg_len must be a positive multiple of 64"),
    ({"block_v": lambda a: 64}, ValueError, "block_v must be None or 128"),
    ({}, ValueError, "on one CUDA device"),  # CPU tensors, every other check passed
])
def test_bad_arguments_are_named(change: dict, error: type, message: str) -> None:
    """Every check of the wrapper runs before anything touches a GPU, and names the argument."""
    candidate = _candidate()
    args = _cpu_arguments()
    args["block_v"] = None
    for name, edit in change.items():
        args[name] = edit(args)
    with pytest.raises(error, match=message):
        candidate.lightning_chunk_output(**args)


# ---- the A/B script's logic (CPU, no CuTeDSL)


def test_ab_shapes_are_the_ones_asked_for() -> None:
    names = [shape.name for shape in ab.SHAPES]
    assert names[0] == "B1 T32768 H64" and names[1] == "B2 T16384 H16" and names[3] == "B1 T4096 H64"
    varlen = ab.SHAPES[2]
    assert varlen.varlen and len(varlen.lens) == 10 and 0 in varlen.lens
    assert any(length % 64 for length in varlen.lens)  # partial last chunks
    assert [s.name for s in ab.select(ab.SHAPES, "T4096, varlen")] == [names[2], names[3]]
    assert ab.select(ab.SHAPES, None) == list(ab.SHAPES)


def test_ab_floor_counts_tokens_and_start_states() -> None:
    # B1 T32768 H64: 4 x 512 MiB of bf16 tokens and 32 segments of 64 heads' 64 KiB start states
    expected = (4 * 32768 * 64 * 128 * 2 + 32 * 64 * 128 * 128 * 4) / 4.3e12 * 1e6
    assert ab.floor_us(32768, 64, 32) == pytest.approx(expected)


def test_ab_table_marks_differing_bits() -> None:
    times = {"product bv64": 100.0, "product bv128": 90.0, "candidate": 50.0}
    row = dict(shape="B1 T4096 H64", seg_len=512, nseg=8, floor=40.0, times=times, reference="product bv64",
               bits={"product bv64": True, "product bv128": True, "candidate": False},
               written=dict.fromkeys(times, True))
    lines = ab.table([row])
    assert lines[0].startswith("| shape | seg_len | NSEG | floor us | product bv64 us |")
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[4:7] == ["100.0", "90.0", "50.0"] and cells[7:9] == ["0.900", "0.500"]
    assert cells[9] == "1.25" and cells[10] == "NO: candidate" and cells[11] == "yes"


# ---- GPU: the product's bits

GPU_CASES = {
    # (rows, ((first row, length), ...), decays per head, seg_len); rows outside every segment are never written
    "gaps-1-64-65-1-33-H3": (300, ((3, 1), (10, 64), (80, 65), (200, 1), (250, 33)), (-0.02, -8.0, 0.0), 128),
    "B2-T1200-seg512-H4": (2400, tuple((b * 1200 + s, min(512, 1200 - s)) for b in range(2)
                                       for s in range(0, 1200, 512)), (0.0, -0.05, -1.0, -8.0), 512),
}


@pytest.mark.gpu
@needs_cutedsl
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_candidate_gives_the_product_bits(case: str) -> None:
    from cula_runtime.cute.lightning.chunk_output import lightning_chunk_output as product

    candidate = _candidate()
    rows, spans, decays, seg_len = GPU_CASES[case]
    H = len(decays)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(rows, H, K, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3))
    g_gamma = torch.tensor(decays, dtype=torch.float32, device="cuda")
    seg_state = 4.0 * torch.randn(len(spans), H, K, K, device="cuda", generator=gen)
    segments = torch.tensor([(0, first, length, 0) for first, length in spans], dtype=torch.int32, device="cuda")
    outputs = []
    for run in (product, candidate.lightning_chunk_output):
        o = torch.full_like(v, float("nan"))
        run(q, k, v, g_gamma, seg_state, segments, o, K ** -0.5, seg_len)
        torch.cuda.synchronize()
        outputs.append(o)
    expected, got = outputs
    covered = torch.zeros(rows, dtype=torch.bool, device="cuda")
    for first, length in spans:
        covered[first:first + length] = True
    assert torch.isfinite(got[covered]).all() and torch.isnan(got[~covered]).all()
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
