"""The kernel registry, as users see it.

``list_kernels(family=None, arch=None, backend=None)`` and ``get_kernel(name)`` return registry entries (name,
family, backend, archs, dtypes, features, status, entry point). ``cula.kernels.kda`` and ``cula.kernels.lightning``
are lazy namespaces: each registered kernel of that family is an attribute, imported on first access.
"""

from __future__ import annotations

from cula_runtime.registry import KERNELS, KernelEntry, get_kernel, list_kernels

__all__ = ["KERNELS", "KernelEntry", "get_kernel", "list_kernels", "kda", "lightning"]


def __getattr__(name: str):
    if name in ("kda", "lightning"):
        import importlib

        return importlib.import_module(f"cula.kernels.{name}")
    raise AttributeError(f"module 'cula.kernels' has no attribute {name!r}")
