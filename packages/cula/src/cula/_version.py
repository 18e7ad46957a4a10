"""The cuLA version (equal to cula-runtime's and cula-sm90's; tests/packaging/test_versions.py checks)."""

__version__ = "0.2.0"
