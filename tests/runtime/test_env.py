"""cula_runtime.env.env_value: what os.environ.get gives, through CPython's encoded mapping when it has one."""

from __future__ import annotations

import os

import pytest

from cula_runtime import env

NAME = "CULA_TEST_ENV_VALUE_KNOB"


@pytest.mark.parametrize("fast", [True, False], ids=["encoded-mapping", "fallback"])
def test_env_value_follows_os_environ(fast: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if fast and not (env._POSIX and type(getattr(os.environ, "_data", None)) is dict):
        pytest.skip("this interpreter has no os.environ._data mapping")
    if not fast:
        monkeypatch.setattr(env, "_POSIX", False)
    monkeypatch.delenv(NAME, raising=False)
    assert env.env_value(NAME, "dflt") == "dflt"
    for value in ("1", "", " sm_90a ", "naïve"):  # set, changed, empty, non-ASCII
        monkeypatch.setenv(NAME, value)
        assert env.env_value(NAME, "dflt") == value == os.environ[NAME]
    monkeypatch.delenv(NAME)
    assert env.env_value(NAME, "dflt") == "dflt"


def test_env_choice_maps_the_value_or_names_what_it_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    choices = {"0": False, "1": True}
    monkeypatch.delenv(NAME, raising=False)
    assert env.env_choice(NAME, "1", choices) is True  # the default
    monkeypatch.setenv(NAME, "0")
    assert env.env_choice(NAME, "1", choices) is False
    monkeypatch.setenv(NAME, "on")
    with pytest.raises(ValueError, match=r"CULA_TEST_ENV_VALUE_KNOB='on': expected one of \['0', '1'\]"):
        env.env_choice(NAME, "1", choices)


def test_a_replaced_os_environ_is_read_through_its_get(monkeypatch: pytest.MonkeyPatch) -> None:
    """Code that swaps os.environ for a mapping of its own (tests counting reads) is served through that mapping."""
    reads: list[str] = []

    class Environ(dict):
        def get(self, key, default=None):
            reads.append(key)
            return super().get(key, default)

    monkeypatch.setattr(os, "environ", Environ({NAME: "x"}))
    assert env.env_value(NAME, "dflt") == "x" and reads == [NAME]


def test_every_call_path_knob_reads_through_env_value() -> None:
    """The knobs read on each call go through env_value (os.environ.get costs ~1-2 us per read on the H200 host)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "packages"
    for rel in ("cula/src/cula/dispatch.py", "cula-runtime/src/cula_runtime/cute/arch.py",
                "cula-runtime/src/cula_runtime/cute/compile_cache.py", "cula-sm90/src/cula_sm90/kda.py"):
        text = (root / rel).read_text(encoding="utf-8")
        assert "os.environ.get(" not in text and "os.getenv(" not in text, rel
        assert "env_value(" in text or "env_choice(" in text, rel  # (env_choice reads through env_value)
    # kda_tuning's per-call choice reads no knob (CULA_BLOCK_V was retired in issue 25)
    text = (root / "cula-runtime/src/cula_runtime/kda_tuning.py").read_text(encoding="utf-8")
    assert "environ" not in text and "getenv" not in text and "env_value" not in text
