"""Lazy namespace of the registered ``lightning`` kernels; ``cula.kernels.lightning.<name>`` loads one on first use."""

from ._namespace import family_namespace

__all__, __getattr__, __dir__ = family_namespace("lightning")
