"""What the CuTeDSL compile tests measured per CuTeDSL version: the installed version's minor release and the
per-version tables (spill counts) keyed by it. Register allocation, hence local-memory spills, changes between
CuTeDSL releases for the same kernel source, so every count is the one measured with that release; a release
nobody measured fails with a message saying what to measure."""

from __future__ import annotations

import functools
import importlib.metadata

import pytest


@functools.cache
def dsl_minor() -> str:
    """``"4.6"``, ``"4.8"``...: the installed ``nvidia-cutlass-dsl``'s major.minor version."""
    return ".".join(importlib.metadata.version("nvidia-cutlass-dsl").split(".")[:2])


def measured(table: dict[str, dict], config_id: str, target: str, what: str = "spill instructions") -> int:
    """``table[dsl_minor()][config_id][target]``; fails the test, naming the version and the table, when the
    installed CuTeDSL (or this configuration on it) was never measured."""
    version = dsl_minor()
    if version not in table:
        pytest.fail(f"nvidia-cutlass-dsl {importlib.metadata.version('nvidia-cutlass-dsl')}: no {what} measured for "
                    f"CuTeDSL {version} (measured: {', '.join(sorted(table))}); compile every configuration with it "
                    f"and add its counts as table[{version!r}]")
    per_config = table[version]
    if config_id not in per_config or target not in per_config[config_id]:
        pytest.fail(f"no {what} measured for {config_id} on {target} with CuTeDSL {version}")
    return per_config[config_id][target]
