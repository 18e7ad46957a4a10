"""cula, cula-runtime and cula-sm90 share one version, and cula pins its siblings to exactly that version.

Each package reads its version from its own ``_version.py`` (setuptools ``attr`` / scikit-build-core's regex
provider); cula's pyproject.toml pins ``cula-runtime`` and ``cula-sm90`` with ``==``. A release bumps all of them
together, and these tests fail until it does.
"""

from __future__ import annotations

import ast
import copy
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]

# dist -> (package folder, import name)
PACKAGES = {
    "cula": ("packages/cula", "cula"),
    "cula-runtime": ("packages/cula-runtime", "cula_runtime"),
    "cula-sm90": ("packages/cula-sm90", "cula_sm90"),
}


def version_of(dist: str) -> str:
    """The literal ``__version__ = "..."`` of a package's _version.py, read without importing it."""
    folder, import_name = PACKAGES[dist]
    path = ROOT / folder / "src" / import_name / "_version.py"
    for node in ast.parse(path.read_text()).body:
        if (
            isinstance(node, ast.Assign)
            and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            return node.value.value
    raise AssertionError(f"{path} has no literal __version__ = '...'")


def pyproject(dist: str) -> dict[str, Any]:
    return tomllib.loads((ROOT / PACKAGES[dist][0] / "pyproject.toml").read_text())


# Each package's pins on its cuLA siblings, by dependency group (None: the base dependencies), with
# {version} standing for the shared version. Every pin is exact: the three wheels release together.
SIBLING_PINS: dict[str, dict[str | None, list[str]]] = {
    "cula": {
        None: ["cula-runtime=={version}"],
        "sm90": ["cula-sm90=={version}"],
        "cute": ["cula-runtime[cute]=={version}"],
    },
    "cula-runtime": {None: []},
    "cula-sm90": {None: ["cula-runtime=={version}"]},
}


def sibling_pin_problems(dist: str, project: dict[str, Any], version: str) -> list[str]:
    """What is wrong with a package's pins on its siblings in a parsed [project] table, given the shared version."""
    problems = []
    groups = {None: project.get("dependencies", []), **project.get("optional-dependencies", {})}
    expected = SIBLING_PINS[dist]
    for group in sorted(set(groups) | set(expected), key=str):
        where = "dependencies" if group is None else f"optional-dependencies.{group}"
        found = [str(r) for r in map(Requirement, groups.get(group, [])) if canonicalize_name(r.name) in PACKAGES]
        wanted = [str(Requirement(r.format(version=version))) for r in expected.get(group, [])]
        if found != wanted:
            problems.append(f"{where}: cuLA pins are {found}, expected {wanted}")
    return problems


def test_the_three_versions_agree() -> None:
    versions = {dist: version_of(dist) for dist in PACKAGES}
    assert len(set(versions.values())) == 1, f"versions differ: {versions}"


@pytest.mark.parametrize("dist", ["cula", "cula-runtime"])
def test_setuptools_reads_the_version_from_version_py(dist: str) -> None:
    config = pyproject(dist)
    assert config["project"]["name"] == dist
    assert "version" in config["project"]["dynamic"] and "version" not in config["project"]
    attr = config["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == f"{PACKAGES[dist][1]}._version.__version__"


def test_scikit_build_reads_the_sm90_version_from_version_py() -> None:
    config = pyproject("cula-sm90")
    assert config["project"]["name"] == "cula-sm90"
    assert "version" in config["project"]["dynamic"] and "version" not in config["project"]
    provider = config["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    assert provider["input"] == "src/cula_sm90/_version.py"


@pytest.mark.parametrize("dist", list(PACKAGES))
def test_sibling_pins_equal_the_shared_version(dist: str) -> None:
    assert sibling_pin_problems(dist, pyproject(dist)["project"], version_of(dist)) == []


@pytest.mark.parametrize(
    ("group", "index", "pin", "expected"),
    [
        pytest.param(None, 1, "cula-runtime==0.1.9", "dependencies: cuLA pins are ['cula-runtime==0.1.9']", id="stale"),
        pytest.param(None, 1, "cula-runtime>=0.2", "dependencies: cuLA pins are ['cula-runtime>=0.2']", id="range"),
        pytest.param("sm90", 0, "cula-sm90", "optional-dependencies.sm90: cuLA pins are ['cula-sm90']", id="unpinned"),
        pytest.param("cute", 0, "cula-runtime=={version}", "optional-dependencies.cute", id="cute-extra-lost"),
    ],
)
def test_pin_check_catches_drift(group: str | None, index: int, pin: str, expected: str) -> None:
    project = copy.deepcopy(pyproject("cula")["project"])
    requirements = project["dependencies"] if group is None else project["optional-dependencies"][group]
    assert requirements[index].startswith(("cula-runtime", "cula-sm90"))
    version = version_of("cula")
    requirements[index] = pin.format(version=version)
    problems = sibling_pin_problems("cula", project, version)
    assert any(p.startswith(expected) for p in problems), problems


def test_pin_check_catches_a_stale_sm90_pin() -> None:
    project = copy.deepcopy(pyproject("cula-sm90")["project"])
    project["dependencies"] = [
        r.replace("==", "==0.0.") if r.startswith("cula") else r for r in project["dependencies"]
    ]
    problems = sibling_pin_problems("cula-sm90", project, version_of("cula-sm90"))
    assert any(p.startswith("dependencies: cuLA pins are ['cula-runtime==0.0.") for p in problems), problems


def test_cutedsl_requirements_agree_with_the_runtime() -> None:
    """cula-runtime's pyproject declares CuTeDSL and TVM-FFI exactly as ``cula_runtime.cute.DSL_REQUIREMENTS`` says
    (the install hint quotes those), on the platforms of ``CUTEDSL_PLATFORMS`` only, and outside any extra."""
    from packaging.markers import Marker

    from cula_runtime import cute

    declared = [Requirement(r) for r in pyproject("cula-runtime")["project"]["dependencies"]]
    dsl = [r for r in declared if canonicalize_name(r.name) in {"nvidia-cutlass-dsl", "apache-tvm-ffi"}]
    assert sorted(f"{r.name}{r.specifier}" for r in dsl) == sorted(
        f"{r.name}{r.specifier}" for r in map(Requirement, cute.DSL_REQUIREMENTS)
    )
    platforms = [("linux", "x86_64"), ("linux", "aarch64"), ("darwin", "arm64"), ("win32", "AMD64"),
                 ("linux", "ppc64le")]
    for requirement in dsl:
        assert requirement.marker is not None, f"{requirement} has no platform marker"
        for system, machine in platforms:
            wanted = (system, machine.lower()) in cute.CUTEDSL_PLATFORMS
            env = {"sys_platform": system, "platform_machine": machine, "extra": ""}
            assert requirement.marker.evaluate(env) is wanted, (requirement, system, machine)
    assert str(Marker('extra == "cute"')) not in {str(r.marker) for r in declared}


def test_the_cute_extra_is_an_accepted_alias() -> None:
    """``cula[cute]`` and ``cula-runtime[cute]`` still resolve (0.2.0's spelling) and add nothing."""
    assert pyproject("cula-runtime")["project"]["optional-dependencies"]["cute"] == []
    cula_cute = pyproject("cula")["project"]["optional-dependencies"]["cute"]
    assert cula_cute == [f"cula-runtime[cute]=={version_of('cula')}"]
