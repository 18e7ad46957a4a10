"""CuTeDSL compilation on the CPU (no GPU): KdaPrepare builds for sm_90a, sm_100a and sm_103a with the machine
code we expect, the compile cache compiles each key once, and one binary serves every T and every cu_seqlens.

The compile tests need CuTeDSL (``pip install "cula-runtime[cute]"``) and skip without it; the import test runs
everywhere.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.cute import arch

needs_cutedsl = pytest.mark.skipif(
    not cula_cute.is_available(), reason='CuTeDSL is not installed (pip install "cula-runtime[cute]")'
)

SM = {"sm_90a": "SM90", "sm_100a": "SM100", "sm_103a": "SM103"}


def _configs() -> dict:
    from cula_runtime.cute.kda.prepare import KdaPrepareConfig

    return {
        "fixed-safe-betaf32-H2-HV4-K128": KdaPrepareConfig(num_heads=2, num_v_heads=4, head_dim=128),
        "varlen-softplus-betabf16-H2-HV4-K128": KdaPrepareConfig(
            num_heads=2, num_v_heads=4, head_dim=128, gate="softplus", beta_dtype="bfloat16", varlen=True
        ),
        "fixed-rawgate-gbf16-nol2norm-H4-HV4-K64": KdaPrepareConfig(
            num_heads=4, num_v_heads=4, head_dim=64, g_dtype="bfloat16", l2norm=False, gate="none",
            has_A_log=False, has_dt_bias=False, beta_sigmoid=False,
        ),
    }


CONFIG_IDS = ["fixed-safe-betaf32-H2-HV4-K128", "varlen-softplus-betabf16-H2-HV4-K128",
              "fixed-rawgate-gbf16-nol2norm-H4-HV4-K64"]


def test_cute_packages_import_without_cutedsl() -> None:
    """cula_runtime.cute and .cute.kda import with CuTeDSL blocked; using a kernel names the install command."""
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"cutlass", "cuda"}:
                    raise ImportError(f"blocked for this test: {name}")
                return None

        sys.meta_path.insert(0, Block())
        import cula_runtime.cute, cula_runtime.cute.kda, cula_runtime.cute.arch
        assert cula_runtime.cute.supported_targets() == ("sm_90a", "sm_100a", "sm_103a")
        assert not [m for m in sys.modules if m.split(".")[0] in {"cutlass", "torch"}]
        try:
            cula_runtime.cute.kda.kda_prepare
        except ImportError as exc:
            print(exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert 'pip install "cula-runtime[cute]"' in result.stdout


@pytest.mark.parametrize(
    ("name", "expected"),
    [("sm_90a", "sm_90a"), ("sm90", "sm_90a"), ("9.0", "sm_90a"), ("SM_100A", "sm_100a"), ("100a", "sm_100a"),
     ("10.3", "sm_103a"), ("sm_103a", "sm_103a")],
)
def test_target_spellings(name: str, expected: str) -> None:
    assert arch.normalize_target(name) == expected


@pytest.mark.parametrize("name", ["sm_80", "sm_120a", "sm_100f", "hopper", ""])
def test_unsupported_targets_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unsupported architecture"):
        arch.normalize_target(name)


def test_the_two_knobs_are_separate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_103a")
    monkeypatch.setenv("CULA_ARCH", "sm_90a")
    assert arch.compile_target() == "sm_103a"
    assert arch.dispatch_target() == "sm_90a"


@pytest.mark.parametrize("target", list(SM))
@pytest.mark.parametrize("config_id", CONFIG_IDS)
@pytest.mark.compile
@needs_cutedsl
def test_kda_prepare_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.compile_cache import compile_kernel, compile_seconds
    from cula_runtime.cute.kda.prepare import KdaPrepare
    from cula_runtime.cute.machine_code import disassemble

    config = _configs()[config_id]
    kernel = KdaPrepare(config)
    code = disassemble(compile_kernel(KdaPrepare, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)
    header = re.search(r"\.target\s+(sm_\d+a?)|EF_CUDA_(SM\d+)", code.sass)
    assert header is not None and header.group(header.lastindex) in (target, SM[target])
    assert compile_seconds(KdaPrepare, config, target) > 0

    # Vector global memory access: every g row segment is one 4-wide access, every q/k row segment one 16-byte one.
    gate_rows = config.chunk_size // kernel.gate_segments * (config.head_dim // kernel.gate_cols)
    g_load = "LDG.E.128" if config.g_dtype == "float32" else "LDG.E.64"
    assert code.count(g_load) >= gate_rows
    l2norm_rows = 2 * config.chunk_size * kernel.qk_threads_per_row // kernel.num_threads if config.l2norm else 0
    assert code.count("STG.E.128") >= gate_rows + l2norm_rows
    if config.l2norm:
        assert code.opcodes["LDG.E.128"] >= gate_rows * (config.g_dtype == "float32") + l2norm_rows
        assert code.count("MUFU.RSQ") >= l2norm_rows  # one rsqrt per row
        assert code.count("SHFL.BFLY") > 0  # the row's sum of squares crosses lanes
        assert code.count("F2FP.BF16.F32.PACK_AB") > 0  # q_hat/k_hat stored as bf16
    else:
        assert code.count("MUFU.RSQ") == 0 and code.count("SHFL") == 0
    # exp of every activated gate channel (softplus or sigmoid) goes through the SFU
    transcendental_gates = gate_rows * kernel.gate_vec if config.gate != "none" else 0
    assert code.count("MUFU.EX2") >= transcendental_gates
    if config.gate == "none" and not config.beta_sigmoid:
        assert code.count("MUFU") == 0
    assert code.count("BAR.SYNC") >= 1  # the cross-run offsets of the cumsum go through shared memory
    assert code.count("LDL") == 0 and code.count("STL") == 0, "register spill"
    assert code.count("HMMA") == 0  # plain CUDA-core kernel


@pytest.mark.compile
@needs_cutedsl
def test_same_config_compiles_once() -> None:
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.prepare import KdaPrepare

    config = _configs()["fixed-rawgate-gbf16-nol2norm-H4-HV4-K64"]
    compile_cache.clear_cache()
    first = compile_cache.compile_kernel(KdaPrepare, config, target="sm_90a")
    again = compile_cache.compile_kernel(KdaPrepare, config, target="sm_90a")
    assert again is first
    assert compile_cache.cache_info() == compile_cache.CacheInfo(hits=1, misses=1, size=1)
    other_target = compile_cache.compile_kernel(KdaPrepare, config, target="sm_100a")
    assert other_target is not first
    assert compile_cache.cache_info().misses == 2
    assert [r.target for r in compile_cache.compile_records()] == ["sm_90a", "sm_100a"]
    with pytest.raises(ValueError, match="cannot implement"):
        compile_cache.compile_kernel(KdaPrepare, _bad_config(), target="sm_90a")


def _bad_config():
    from cula_runtime.cute.kda.prepare import KdaPrepareConfig

    return KdaPrepareConfig(num_heads=1, num_v_heads=1, head_dim=100)


def _normalised(mlir_type: object) -> str:
    """A tensor type without what only the compile side states (address space, stride divisibility)."""
    return re.sub(r" div=\d+", "", str(mlir_type)).replace("generic", "gmem")


@pytest.mark.compile
@needs_cutedsl
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_one_binary_serves_every_length(varlen: bool) -> None:
    """The launch arguments for T = 100 and T = 1000 (and two cu_seqlens) have exactly the compiled argument types,
    and the compiled callable marshals both: no recompilation, no mismatch."""
    import cuda.bindings.driver as cuda
    from cutlass._mlir import ir

    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.prepare import KdaPrepare, KdaPrepareConfig

    H, HV, K = 2, 4, 128
    config = KdaPrepareConfig(num_heads=H, num_v_heads=HV, head_dim=K, varlen=varlen)
    compile_cache.clear_cache()
    compiled = compile_cache.compile_kernel(KdaPrepare, config, target="sm_90a")
    specs = KdaPrepare(config).argument_specs()
    fakes = [None if spec is None else spec.fake() for spec in specs]
    marshalled = []
    for B, T, cu in ((1, 100, [0, 40, 40, 100]), (1 if varlen else 3, 1000, [0, 1000])):
        bf16, f32 = torch.bfloat16, torch.float32
        cu_seqlens = torch.tensor(cu, dtype=torch.int32) if varlen else None
        chunk_indices = None
        if varlen:
            from cula_runtime.index import prepare_chunk_indices

            chunk_indices = prepare_chunk_indices(cu_seqlens, 64)
        tensors = (
            torch.randn(B, T, H, K, dtype=bf16), torch.randn(B, T, H, K, dtype=bf16), torch.randn(B, T, HV, K),
            torch.randn(B, T, HV), torch.randn(HV), torch.randn(HV, K), torch.empty(B, T, H, K, dtype=bf16),
            torch.empty(B, T, H, K, dtype=bf16), torch.empty(B, T, HV, K, dtype=f32), torch.empty(B, T, HV),
            cu_seqlens, chunk_indices,
        )
        args = [None if s is None else s.launch_arg(t) for s, t in zip(specs, tensors, strict=True)]
        with ir.Context():
            for arg, fake in zip(args, fakes, strict=True):
                assert (arg is None) == (fake is None)
                if arg is not None:
                    assert _normalised(arg.mlir_type) == _normalised(fake.mlir_type)
        exe_args, _ = compiled.generate_execution_args(*args, -5.0, cuda.CUstream(0))
        marshalled.append(len(exe_args))
    assert marshalled[0] == marshalled[1] == sum(spec is not None for spec in specs) + 2
    assert compile_cache.cache_info().misses == 1


@pytest.mark.compile
@needs_cutedsl
@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"head_dim": 100}, "power of two"),
        ({"chunk_size": 32}, "only 64"),
        ({"num_v_heads": 3}, "multiple"),
        ({"gate": "softplus", "has_A_log": False}, "needs A_log"),
        ({"gate": "none"}, "only used by an in-kernel gate"),
        ({"beta_sigmoid": False, "allow_neg_eigval": True}, "requires beta_sigmoid"),
        ({"qk_dtype": "float32", "head_dim": 256}, "one warp"),
        ({"g_dtype": "float64"}, "expected one of"),
    ],
)
def test_can_implement_says_why(changes: dict, reason: str) -> None:
    import dataclasses

    from cula_runtime.cute.kda.prepare import KdaPrepare, KdaPrepareConfig

    config = dataclasses.replace(KdaPrepareConfig(num_heads=2, num_v_heads=4, head_dim=128), **changes)
    ok, why = KdaPrepare.can_implement(config)
    assert not ok and reason in why


@pytest.mark.compile
@needs_cutedsl
def test_launch_arg_copies_inputs_and_refuses_outputs_that_break_the_promises() -> None:
    import cutlass

    from cula_runtime.cute.compile_cache import TensorSpec

    spec = TensorSpec(cutlass.BFloat16, 4, 8)
    fused = torch.randn(2, 10, 3, 2 * 128, dtype=torch.bfloat16)
    assert spec.conforms(fused[..., :128])  # a q slice of a fused projection keeps the promises: no copy
    odd = torch.randn(2, 10, 3, 129, dtype=torch.bfloat16)[..., 1:]
    assert not spec.conforms(odd)
    spec.launch_arg(odd)  # an input is copied
    with pytest.raises(ValueError, match="layout promise"):
        spec.launch_arg(odd, output=True)
