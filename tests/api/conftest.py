"""Fixtures of the API tests: ``fake_sm90``, the sm90 shim launching on a stand-in extension (CPU tensors)."""

from __future__ import annotations

import contextlib

import pytest

from tests.api.fake_sm90 import FakeExtension, shim


@pytest.fixture
def fake_sm90(monkeypatch: pytest.MonkeyPatch):
    """(``cula_sm90.kda``, a :class:`FakeExtension` it launches on), with the stream, device guard and SM count
    stubbed and the shim's knobs unset."""
    kda = shim()
    fake = FakeExtension()
    monkeypatch.setattr(kda, "load_extension", lambda: fake)
    monkeypatch.setattr(kda, "_current_stream", lambda index: 777)
    monkeypatch.setattr(kda, "_device_guard", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(kda, "sm_count", lambda device: 132)
    monkeypatch.delenv(kda.ENV_INTRA_TUNED, raising=False)
    monkeypatch.delenv(kda.ENV_PROGRAMMATIC_LAUNCH, raising=False)
    return kda, fake
