"""cuLA inside other libraries' own entry points. Each integration imports its library only where it is installed,
and only once the program imports it.

- :mod:`cula.integrations.fla`: cuLA as a backend of FLA's registry (fla-core >= 0.6.0): FLA's ``chunk_kda`` and
  its KDA decode entry run on cuLA for the calls cuLA serves. :func:`autoregister_fla` (run by ``import cula``)
  registers it without importing FLA: where FLA is installed, it waits for FLA's KDA ops (``fla.ops.kda``) to be
  imported, by the program, at any later time, and registers the backend right after that module has run (FLA
  0.6.0 offers no plugin hook of its own); where they are imported already, it registers at once. Importing FLA's
  KDA ops costs seconds (triton, every FLA op), which a program that never uses FLA must not pay.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Callable
from types import ModuleType

__all__ = ["FLA_KDA_MODULE", "autoregister_fla"]

#: the FLA module whose import triggers the registration (it defines ``chunk_kda`` and the KDA decode entry)
FLA_KDA_MODULE = "fla.ops.kda"


def autoregister_fla() -> None:
    """Register cuLA's FLA backend now if FLA's KDA ops are loaded, or as soon as they are (where FLA is installed);
    do nothing where FLA is not installed. Never imports FLA. A failure to register is a ``RuntimeWarning`` (FLA
    then runs its own kernels), never an error in the program's ``import fla``."""
    if FLA_KDA_MODULE in sys.modules:
        _register_fla_or_warn()
        return
    try:
        installed = importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):  # (a finder that refuses it, or a stand-in module without a spec)
        installed = False
    if installed and not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(FLA_KDA_MODULE, _register_fla_or_warn))


def _register_fla_or_warn() -> None:
    try:
        from .fla import register

        register()
    except Exception as error:  # (FLA's import must not fail because of cuLA: said, not swallowed)
        warnings.warn(f"cula could not register its FLA backend ({type(error).__name__}: {error}); FLA runs its own "
                      "kernels. cula.integrations.fla.register() raises the error itself", RuntimeWarning,
                      stacklevel=2)


class _AfterImport:
    """A ``sys.meta_path`` finder that runs ``callback`` right after the module ``name`` has been executed: it finds
    the module's spec with the other finders and wraps its loader; the original loader is put back on the module
    once it has run. It removes itself from ``sys.meta_path`` on first use."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name = name
        self.callback = callback

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = None if find is None else find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # (a namespace package or an old-style loader: nothing to wrap; no registration)
        spec.loader = _ThenCall(spec.loader, self.callback)
        return spec

    def invalidate_caches(self) -> None:
        pass


class _ThenCall:
    """A loader that runs ``loader`` and then ``callback`` (every other attribute is ``loader``'s)."""

    def __init__(self, loader, callback: Callable[[], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if getattr(module, "__spec__", None) is not None:
                module.__spec__.loader = self._loader
        self._callback()

    def __getattr__(self, name: str):
        if name in ("_loader", "_callback"):  # (not set yet: an object made without __init__, as copy does)
            raise AttributeError(name)
        return getattr(self._loader, name)
