"""CuTeDSL compilation on the CPU (no GPU): the compile cache compiles each key once, per target, and one binary
serves every T and every cu_seqlens (shown on the recurrence kernel, the quickest to compile); the packages import
without CuTeDSL; the architecture knobs. The kernels' machine code is checked by the test_kda_*_compile.py files.

The compile tests need CuTeDSL and TVM-FFI (cula-runtime brings them on Linux x86_64/aarch64) and skip without
them; the import and architecture tests run everywhere.
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
    not cula_cute.is_available(),
    reason="CuTeDSL or TVM-FFI is not installed (cula-runtime brings them on Linux x86_64/aarch64)",
)

SM = {"sm_90a": "SM90", "sm_100a": "SM100", "sm_103a": "SM103"}


def _recurrence_config(**fields):
    from cula_runtime.cute.kda.recurrence import KdaRecurrenceConfig

    return KdaRecurrenceConfig(**{"num_v_heads": 4, **fields})


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
            cula_runtime.cute.kda.chunk_kda_fwd_intra_from_raw
        except ImportError as exc:
            print(exc)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert cula_cute.DSL_REQUIREMENTS[0] in result.stdout or "has no build for" in result.stdout


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


@pytest.mark.compile
@needs_cutedsl
def test_same_config_compiles_once() -> None:
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.recurrence import KdaRecurrence

    config = _recurrence_config()
    compile_cache.clear_cache()
    first = compile_cache.compile_kernel(KdaRecurrence, config, target="sm_90a")
    again = compile_cache.compile_kernel(KdaRecurrence, config, target="sm_90a")
    assert again is first
    assert compile_cache.cache_info() == compile_cache.CacheInfo(hits=1, misses=1, size=1)
    other_target = compile_cache.compile_kernel(KdaRecurrence, config, target="sm_100a")
    assert other_target is not first
    assert compile_cache.cache_info().misses == 2
    assert [r.target for r in compile_cache.compile_records()] == ["sm_90a", "sm_100a"]
    with pytest.raises(ValueError, match="cannot implement"):
        compile_cache.compile_kernel(KdaRecurrence, dataclasses.replace(config, head_dim=64), target="sm_90a")


@pytest.mark.compile
@needs_cutedsl
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_one_binary_serves_every_length(varlen: bool) -> None:
    """Nothing length-dependent is compiled in: every extent of every tensor argument is symbolic, and the launch
    arguments for T = 100 and T = 1000 (and two cu_seqlens) are the caller's tensors, unchanged, for one binary."""
    from cula_runtime.cute import compile_cache
    from cula_runtime.cute.kda.recurrence import KdaRecurrence
    from cula_runtime.index import prepare_chunk_offsets, prepare_sequence_order

    HV, K = 4, 128
    config = _recurrence_config(num_v_heads=HV, varlen=varlen, has_initial_state=True, output_final_state=True)
    compile_cache.clear_cache()
    compiled = compile_cache.compile_kernel(KdaRecurrence, config, target="sm_90a")
    specs = KdaRecurrence(config).argument_specs()
    for spec in specs:
        if spec is not None:
            fake = spec.fake()
            assert all(fake.dynamic_shapes_mask) and fake.dynamic_strides_mask[:-1] == (1,) * (spec.ndim - 1)
    for B, T, cu in ((1, 100, [0, 40, 40, 100]), (1 if varlen else 3, 1000, [0, 1000])):
        bf16 = torch.bfloat16
        cu_seqlens = torch.tensor(cu, dtype=torch.int32) if varlen else None
        N = len(cu) - 1 if varlen else B
        rows = sum(-(-(e - s) // 64) for s, e in zip(cu, cu[1:], strict=False)) if varlen else -(-T // 64)
        tensors = (
            *(torch.randn(B, T, HV, K, dtype=bf16) for _ in range(4)), torch.randn(B, T, HV, 64, dtype=bf16),
            torch.randn(B, rows, HV, K), torch.randn(N, HV, K, K), torch.empty(B, T, HV, K, dtype=bf16),
            torch.empty(N, HV, K, K), cu_seqlens,
            prepare_chunk_offsets(cu_seqlens, 64) if varlen else None,
            prepare_sequence_order(cu_seqlens) if varlen else None,
            None, None, None,  # (no state pool, slot indices or has_initial_state flags)
        )
        for i, (spec, tensor) in enumerate(zip(specs, tensors, strict=True)):
            assert (spec is None) == (tensor is None)
            if spec is not None:
                assert spec.launch_arg(tensor, output=i in (7, 8)) is tensor
        assert compile_cache.compile_kernel(KdaRecurrence, config, target="sm_90a") is compiled
    assert compile_cache.cache_info().misses == 1


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


@pytest.mark.parametrize(
    ("system", "machine", "supported"),
    [("linux", "x86_64", True), ("linux", "aarch64", True), ("darwin", "arm64", False), ("win32", "AMD64", False)],
)
def test_platform_note_names_the_platform(monkeypatch, system: str, machine: str, supported: bool) -> None:
    """Where NVIDIA ships no CuTeDSL, the reason names the platform and says the reference backend runs."""
    monkeypatch.setattr(cula_cute.sys, "platform", system)
    monkeypatch.setattr(cula_cute.platform, "machine", lambda: machine)
    note = cula_cute.platform_note()
    if supported:
        assert note is None
    else:
        assert f"{system} {machine.lower()}" in note and "reference backend" in note
        monkeypatch.setattr(cula_cute, "_found", False)
        monkeypatch.setattr(cula_cute, "_installed", lambda name: False)
        assert cula_cute.unavailable_reason() == note


def test_unavailable_reason_names_the_missing_packages(monkeypatch) -> None:
    """On a supported platform with the packages missing (installed with --no-deps), the fix quotes the range."""
    monkeypatch.setattr(cula_cute.sys, "platform", "linux")
    monkeypatch.setattr(cula_cute.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cula_cute, "_found", False)
    monkeypatch.setattr(cula_cute, "_installed", lambda name: name != "tvm_ffi")
    reason = cula_cute.unavailable_reason()
    assert reason.startswith("apache-tvm-ffi not installed")
    assert all(f'"{r}"' in reason for r in cula_cute.DSL_REQUIREMENTS)
