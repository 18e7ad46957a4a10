"""Lazy namespace of the registered ``kda`` kernels: ``cula.kernels.kda.<name>`` imports the kernel on first use."""

from ._namespace import family_namespace

__all__, __getattr__, __dir__ = family_namespace("kda")
