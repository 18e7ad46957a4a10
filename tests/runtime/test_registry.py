"""The kernel registry: every entry well-formed and resolvable; the lazy namespaces match it both ways."""

from __future__ import annotations

import importlib.util

import pytest

import cula.kernels
from cula_runtime import registry

KNOWN_ARCHS = {"any", "cpu", "sm_90a", "sm_100a", "sm_103a"}
_NEEDS = {"cutedsl": "cutlass", "sm90-native": "cula_sm90"}


@pytest.mark.parametrize("entry", registry.KERNELS, ids=[e.name for e in registry.KERNELS])
def test_entry_is_well_formed(entry: registry.KernelEntry) -> None:
    assert entry.family in registry.FAMILIES
    assert entry.backend in registry.BACKENDS
    assert entry.archs and set(entry.archs) <= KNOWN_ARCHS
    assert entry.status.strip() and entry.summary.strip() and entry.dtypes
    assert ":" in entry.entry and entry.entry.split(":")[0].startswith(("cula_runtime.", "cula_sm90"))


@pytest.mark.parametrize("entry", registry.KERNELS, ids=[e.name for e in registry.KERNELS])
def test_entry_resolves_to_a_callable(entry: registry.KernelEntry) -> None:
    needed = _NEEDS.get(entry.backend)
    if needed is not None and importlib.util.find_spec(needed) is None:
        pytest.skip(f"{entry.name} needs {needed}, which is not installed")
    assert callable(entry.load())


@pytest.mark.parametrize("family", registry.FAMILIES)
def test_namespace_exports_exactly_the_registered_kernels(family: str) -> None:
    namespace = getattr(cula.kernels, family)
    registered = {e.name for e in registry.list_kernels(family=family)}
    assert set(namespace.__all__) == registered
    assert set(dir(namespace)) == registered
    for name in registered:
        needed = _NEEDS.get(registry.get_kernel(name).backend)
        if needed is None or importlib.util.find_spec(needed) is not None:
            assert getattr(namespace, name) is registry.get_kernel(name).load()
    with pytest.raises(AttributeError, match="registered"):
        namespace.no_such_kernel  # noqa: B018


def test_list_and_get() -> None:
    assert {e.name for e in cula.kernels.list_kernels(family="lightning")} >= {"lightning_naive", "lightning_decode"}
    assert all(e.backend == "reference" for e in cula.kernels.list_kernels(backend="reference"))
    assert cula.kernels.list_kernels(arch="sm_100a")  # "any" entries run everywhere
    assert cula.kernels.get_kernel("kda_naive").family == "kda"
    with pytest.raises(KeyError, match="kda_naive"):
        cula.kernels.get_kernel("nope")
    with pytest.raises(ValueError, match="family"):
        cula.kernels.list_kernels(family="mamba")
