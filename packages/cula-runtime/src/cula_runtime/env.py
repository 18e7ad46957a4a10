"""The CULA_* / CUTE_DSL_ARCH knobs read on every call, read fast.

``os.environ.get`` encodes its key on every call: about 0.8 us here and 1.5-2 us on the H200's host, and a
``kda_prefill`` call reads five or more knobs before its first launch, while the GPU waits. CPython keeps the encoded
mapping behind ``os.environ`` in its ``_data`` dict, which every change made through ``os.environ`` (``setenv`` in
tests included) updates; a lookup there with a key encoded once costs about 0.15 us, call included. Where that
mapping is missing (not CPython on POSIX, or ``os.environ`` replaced by another mapping) this falls back to
``os.environ.get``. Like ``os.environ`` itself, it does not see ``os.putenv``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["env_choice", "env_snapshot", "env_value"]

T = TypeVar("T")

_POSIX = os.name == "posix"
_KEYS: dict[str, bytes] = {}


def env_value(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, without encoding ``name`` on every call. ``os.environ`` is looked up on
    each call, so code that replaces it (a test counting reads) is still served through its ``get``."""
    key = _KEYS.get(name)
    if key is None:  # (every name asked for is kept, also for env_snapshot)
        key = _KEYS[name] = os.fsencode(name)
    data = getattr(os.environ, "_data", None) if _POSIX else None
    if type(data) is not dict:
        return os.environ.get(name, default)
    raw = data.get(key)
    return default if raw is None else os.fsdecode(raw)


def env_snapshot() -> tuple:
    """The raw values (None: unset) of every variable :func:`env_value` has been asked for in this process, in the
    order they were first asked for. Two equal snapshots mean :func:`env_value` answers alike for all those names,
    so a decision made from knobs can be cached under it: a knob read for the first time lengthens the snapshot, a
    changed one changes it. About 0.05 us per name."""
    data = getattr(os.environ, "_data", None) if _POSIX else None
    if type(data) is not dict:
        return tuple(os.environ.get(name) for name in _KEYS)
    return tuple(map(data.get, _KEYS.values()))


def env_choice(name: str, default: str, choices: Mapping[str, T]) -> T:
    """What ``choices`` maps the variable ``name`` (``default`` when unset) to.

    Raises:
        ValueError: naming the variable, its value and the accepted ones, when the value is not a key of ``choices``.
    """
    value = env_value(name, default)
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {sorted(choices)}")
    return choices[value]
