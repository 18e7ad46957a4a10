"""What every CuTeDSL compile test (tests/cute/test_*_compile.py) starts from: the ``compile`` marks with the skip
when CuTeDSL or TVM-FFI is missing, the targets and the SM each one names, the (config_id, target) parameters with
the oldest-CuTeDSL case marked ``dsl_floor``, compiling one configuration for one target into its machine code, and
the check of its local-memory spills against the measured table; and, for the host-path tests, a recorder in place
of ``compile_kernel`` (nothing compiles or runs)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pytest

from cula_runtime import cute as cula_cute
from tests.cute.dsl_versions import measured

COMPILE_MARKS = [
    pytest.mark.compile,
    pytest.mark.skipif(
        not cula_cute.is_available(),
        reason="CuTeDSL or TVM-FFI is not installed (cula-runtime brings them on Linux x86_64/aarch64)",
    ),
]

# compile target -> the SM its machine code names
SM = {"sm_90a": "SM90", "sm_100a": "SM100", "sm_103a": "SM103"}

MMA_PREFIXES = ("HMMA", "HGMMA", "UTCHMMA", "UTCQMMA", "UTCMMA")


def compile_params(config_ids: Iterable[str], dsl_floor: str | Collection[str],
                   sm90_only: Collection[str] = ()) -> list:
    """``pytest.param(config_id, target)`` for every configuration and target (only sm_90a for those in
    ``sm90_only``), id ``"{config_id}-{target}"``; the ``dsl_floor`` configuration(s) marked ``dsl_floor`` (compiled
    by ``nox -s cute_compile_oldest`` too)."""
    floor = {dsl_floor} if isinstance(dsl_floor, str) else set(dsl_floor)
    return [pytest.param(config_id, target, id=f"{config_id}-{target}",
                         marks=[pytest.mark.dsl_floor] if config_id in floor else [])
            for config_id in config_ids for target in SM if target == "sm_90a" or config_id not in sm90_only]


def compile_machine_code(kernel_cls: type, config, target: str, *, timed: bool = True):
    """The :class:`cula_runtime.cute.machine_code.MachineCode` of ``kernel_cls(config)`` compiled for ``target``
    (through the compile cache), checked to name ``target`` and its SM; ``timed``: its compile time was recorded."""
    from cula_runtime.cute.compile_cache import compile_kernel, compile_seconds
    from cula_runtime.cute.machine_code import disassemble

    code = disassemble(compile_kernel(kernel_cls, config, target=target))
    assert (code.sm, code.target) == (SM[target], target)
    if timed:
        assert compile_seconds(kernel_cls, config, target) > 0
    return code


def assert_simt_only(code) -> None:
    """No MMA of any flavour (warp, warpgroup or tcgen05) and no tcgen05 instruction at all."""
    for prefix in MMA_PREFIXES:
        assert code.count(prefix) == 0, prefix
    assert not [op for op in code.opcodes if op.startswith("UTC")]


def assert_measured_spills(code, table: dict[str, dict], config_id: str, target: str) -> int:
    """Local loads + stores (LDL + STL), checked to be at most the count measured with the installed CuTeDSL
    (``table`` as :func:`tests.cute.dsl_versions.measured` reads it); returns them."""
    spills = code.count("LDL") + code.count("STL")
    assert spills <= measured(table, config_id, target), f"register spill: {spills} local loads + stores"
    return spills


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace ``compile_cache.compile_kernel`` by a recorder (launches run on sm_90a, nothing compiles or runs) and
    return the list it fills: every launch as ``(kernel class, config, arguments)``."""
    from cula_runtime.cute import compile_cache

    calls: list = []
    monkeypatch.setattr(compile_cache, "compile_kernel",
                        lambda kernel_cls, config, *, target=None: lambda *a: calls.append((kernel_cls, config, a)))
    monkeypatch.setattr(compile_cache, "launch_target", lambda index: "sm_90a")
    monkeypatch.setattr(compile_cache, "_launchable", {})
    return calls


def launch_flow(launches: list, args) -> list:
    """The launches as comparable records: (kernel class, config, scalars, one label per tensor argument). A label
    says where the tensor comes from: ``("arg", name)`` a user tensor itself, ``("view", name, shape, strides)`` a
    view of one, ``("launch", i, j)`` the tensor launch ``i`` had as argument ``j`` (an output it wrote), or
    ``("new", shape, dtype, strides, contiguous, 16-byte aligned)``."""
    inputs = {name: getattr(args, name) for name in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state",
                                                       "cu_seqlens")}
    seen: dict[int, tuple] = {}
    records = []
    for i, (kernel_cls, config, call_args) in enumerate(launches):
        n = len(kernel_cls(config).argument_specs())
        labels = []
        for j, t in enumerate(call_args[:n]):
            if t is None:
                labels.append(None)
                continue
            name = next((name for name, x in inputs.items() if x is t), None)
            if name is not None:
                labels.append(("arg", name))
            elif id(t) in seen:
                labels.append(seen[id(t)])
            else:
                base = next((name for name, x in inputs.items() if x is not None and x.numel() and t.numel()
                             and x.data_ptr() == t.data_ptr()), None)
                if base is not None:
                    labels.append(("view", base, tuple(t.shape), t.stride()))
                else:
                    labels.append(("new", tuple(t.shape), t.dtype, t.stride(), t.is_contiguous(),
                                   t.data_ptr() % 16 == 0))
                seen[id(t)] = ("launch", i, j)
        records.append((kernel_cls, config, call_args[n:], labels))
    return records


def assert_exchange_barriers(code, lines: int) -> None:
    """The K-first decode exchange's barriers: the CTA's (``BAR.SYNC 0x0``) with one line group, else each group's
    named barrier of its 128 threads (the id in a register, ``1 + warp // 4``)."""
    import re

    bars = [line.split("*/")[-1].strip() for line in code.sass.splitlines() if "BAR." in line]
    pattern = r"BAR\.SYNC\.DEFER_BLOCKING 0x0 ;" if lines <= 1 else r"BAR\.SYNC\.DEFER_BLOCKING R\d+, 0x80 ;"
    assert bars and all(re.fullmatch(pattern, bar) for bar in bars), bars
