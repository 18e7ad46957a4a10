"""Builds a lazy module namespace over one registry family (shared by ``cula.kernels.kda`` and ``.lightning``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cula_runtime.registry import list_kernels


def family_namespace(family: str) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for a module exposing every registered kernel of ``family``."""
    entries = {entry.name: entry for entry in list_kernels(family=family)}
    names = sorted(entries)

    def getattr_(name: str) -> Any:
        entry = entries.get(name)
        if entry is None:
            raise AttributeError(f"cula.kernels.{family} has no kernel {name!r}; registered: {names}")
        return entry.load()

    def dir_() -> list[str]:
        return list(names)

    return names, getattr_, dir_
