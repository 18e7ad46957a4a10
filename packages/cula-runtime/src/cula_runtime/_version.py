"""The cuLA version: one value, shared by cula, cula-runtime and cula-sm90 (a test checks they agree)."""

__version__ = "0.2.0"
