"""cula_sm90: cuLA's native kernels for NVIDIA Hopper (sm_90a).

Importing this package needs neither a GPU nor torch: the compiled module ``cula_sm90._C`` is loaded
on first use by :func:`load_extension`, which raises ImportError with the fix when it cannot be.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from ._version import __version__

__all__ = ["__version__", "load_extension"]


@functools.cache
def load_extension() -> ModuleType:
    """Import and return ``cula_sm90._C``, checking it was built for this version of the package."""
    try:
        extension = importlib.import_module(f"{__name__}._C")
    except ImportError as error:
        raise ImportError(
            f"cula_sm90 {__version__}: its compiled extension cula_sm90._C could not be loaded ({error}). "
            f"Install a cula-sm90 wheel built for this Python and platform "
            f"(pip install --force-reinstall 'cula-sm90=={__version__}'), or build one from source with the "
            f"CUDA toolkit (nvcc) on PATH (pip install packages/cula-sm90)."
        ) from error
    built = extension.version()
    if built != __version__:
        raise ImportError(
            f"cula_sm90: the compiled extension is version {built} but the Python package is {__version__}; "
            f"a stale build is installed. Reinstall: pip install --force-reinstall 'cula-sm90=={__version__}'."
        )
    return extension
