"""CuTeDSL compilation on the CPU (no GPU): KdaPrepare builds for sm_90a, sm_100a and sm_103a with the machine
code we expect, the compile cache compiles each key once, and one binary serves every T and every cu_seqlens.

The compile tests need CuTeDSL and TVM-FFI (``pip install "cula-runtime[cute]"``) and skip without them; the import
and architecture tests run everywhere.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import torch

from cula_runtime import cute as cula_cute
from cula_runtime.cute import arch

needs_cutedsl = pytest.mark.skipif(
    not cula_cute.is_available(), reason='CuTeDSL or TVM-FFI is not installed (pip install "cula-runtime[cute]")'
)

SM = {"sm_90a": "SM90", "sm_100a": "SM100", "sm_103a": "SM103"}


# KdaPrepareConfig fields of the compiled configurations (built lazily: the kernel module imports CuTeDSL)
CONFIGS = {
    "fixed-safe-betaf32-H2-HV4-K128": dict(num_heads=2, num_v_heads=4, head_dim=128),
    "varlen-softplus-betabf16-H2-HV4-K128": dict(
        num_heads=2, num_v_heads=4, head_dim=128, gate="softplus", beta_dtype="bfloat16", varlen=True
    ),
    "fixed-rawgate-gbf16-nol2norm-H4-HV4-K64": dict(
        num_heads=4, num_v_heads=4, head_dim=64, g_dtype="bfloat16", l2norm=False, gate="none", has_A_log=False,
        has_dt_bias=False, beta_sigmoid=False,
    ),
}


def _config(config_id: str):
    from cula_runtime.cute.kda.prepare import KdaPrepareConfig

    return KdaPrepareConfig(**CONFIGS[config_id])


def test_cute_packages_import_without_cutedsl() -> None:
    """cula_runtime.cute and .cute.kda import with CuTeDSL blocked; using a kernel names the install command."""
    code = textwrap.dedent(
        """
        import sys

        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"cutlass", "cuda", "tvm_ffi"}:
                    raise ImportError(f"blocked for this test: {name}")
                return None

        sys.meta_path.insert(0, Block())
        import cula_runtime.cute, cula_runtime.cute.kda, cula_runtime.cute.arch
        assert cula_runtime.cute.supported_targets() == ("sm_90a", "sm_100a", "sm_103a")
        assert not cula_runtime.cute.is_available()
        assert not [m for m in sys.modules if m.split(".")[0] in {"cutlass", "tvm_ffi", "torch"}]
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
@pytest.mark.parametrize("config_id", list(CONFIGS))
@pytest.mark.compile
@needs_cutedsl
def test_kda_prepare_machine_code(config_id: str, target: str) -> None:
    from cula_runtime.cute.compile_cache import compile_kernel, compile_seconds
    from cula_runtime.cute.kda.prepare import KdaPrepare
    from cula_runtime.cute.machine_code import disassemble

    config = _config(config_id)
    kernel = KdaPrepare(config)
    code = disassemble(compile_kernel(KdaPrepare, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)  # ELF header and nvdisasm's header agree on it
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

    config = _config("fixed-rawgate-gbf16-nol2norm-H4-HV4-K64")
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
        compile_cache.compile_kernel(KdaPrepare, dataclasses.replace(config, head_dim=100), target="sm_90a")


@pytest.mark.compile
@needs_cutedsl
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_one_binary_serves_every_length(varlen: bool) -> None:
    """Nothing length-dependent is compiled in: every extent of every tensor argument is symbolic, and the launch
    arguments for T = 100 and T = 1000 (and two cu_seqlens) are the caller's tensors, unchanged, for one binary."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.prepare import KdaPrepare, KdaPrepareConfig
    from cula_runtime.index import prepare_chunk_indices

    H, HV, K = 2, 4, 128
    config = KdaPrepareConfig(num_heads=H, num_v_heads=HV, head_dim=K, varlen=varlen)
    compile_cache.clear_cache()
    compiled = compile_cache.compile_kernel(KdaPrepare, config, target="sm_90a")
    specs = KdaPrepare(config).argument_specs()
    for spec in specs:
        if spec is not None:
            fake = spec.fake()
            assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)
    for B, T, cu in ((1, 100, [0, 40, 40, 100]), (1 if varlen else 3, 1000, [0, 1000])):
        bf16 = torch.bfloat16
        cu_seqlens = torch.tensor(cu, dtype=torch.int32) if varlen else None
        tensors = (
            torch.randn(B, T, H, K, dtype=bf16), torch.randn(B, T, H, K, dtype=bf16), torch.randn(B, T, HV, K),
            torch.randn(B, T, HV), torch.randn(HV), torch.randn(HV, K), torch.empty(B, T, H, K, dtype=bf16),
            torch.empty(B, T, H, K, dtype=bf16), torch.empty(B, T, HV, K), torch.empty(B, T, HV),
            cu_seqlens, prepare_chunk_indices(cu_seqlens, 64) if varlen else None,
        )
        for i, (spec, tensor) in enumerate(zip(specs, tensors, strict=True)):
            assert (spec is None) == (tensor is None)
            if spec is not None:
                assert spec.launch_arg(tensor, output=6 <= i <= 9) is tensor
        assert compile_cache.compile_kernel(KdaPrepare, config, target="sm_90a") is compiled
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
    copy = spec.launch_arg(odd)  # an input is copied
    assert copy is not odd and spec.conforms(copy) and torch.equal(copy, odd)
    with pytest.raises(ValueError, match="layout promise"):
        spec.launch_arg(odd, output=True)


def test_is_available_looks_up_until_found(monkeypatch) -> None:
    """is_available() asks importlib until both packages are found, then answers from memory (it runs on every
    cutedsl call); an absent package is looked up again on the next call."""
    import importlib.util

    import cula_runtime.cute as cute

    lookups: list[str] = []
    real = importlib.util.find_spec
    monkeypatch.setattr(cute, "_found", False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: lookups.append(name) or None)
    assert not cute.is_available() and not cute.is_available()
    assert lookups == ["cutlass", "cutlass"]  # (all() stops at the first missing one)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: lookups.append(name) or real(name))
    lookups.clear()
    assert cute.is_available() and cute.is_available()
    assert lookups == ["cutlass", "tvm_ffi"]
