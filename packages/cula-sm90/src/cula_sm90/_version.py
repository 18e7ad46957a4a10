"""The cula-sm90 version: equal to cula's and cula-runtime's (tests/packaging/test_versions.py checks)."""

__version__ = "0.2.0"
