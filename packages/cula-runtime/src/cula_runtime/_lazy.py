"""Lazy module exports: a name is imported from its defining module on first access (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(namespace: dict[str, Any], exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list]]:
    """``(__getattr__, __dir__)`` for the module whose globals are ``namespace``.

    ``exports`` maps each public name to the module that defines it; a resolved name is stored in ``namespace`` so
    later lookups are plain attribute reads.
    """
    module_name = namespace["__name__"]

    def getattr_(name: str) -> Any:
        source = exports.get(name)
        if source is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(source), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(namespace.get("__all__", exports))

    return getattr_, dir_
