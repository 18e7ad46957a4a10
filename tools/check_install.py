"""Check a plain install of cuLA's pure wheels (``pip install cula-runtime cula``, no extra): on Linux x86_64 or
aarch64 it must bring CuTeDSL and TVM-FFI, in the range cula-runtime declares, and make the CuTeDSL kernels
available; the declared range must admit both ends CI compiles against. Run by ``nox -s wheel_inspect`` in a fresh
virtual environment holding only the built wheels and their dependencies.

    python tools/check_install.py [--admits 4.6.2 --admits 4.8.1]

Exit status 0 when every check passes; otherwise each problem is printed and the status is 1.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from packaging.requirements import Requirement
from packaging.version import Version

# The two ends of the CuTeDSL range that CI compiles every shipped kernel against (noxfile.py).
TESTED_ENDS = ("4.6.2", "4.8.1")


def declared(dist: str, name: str) -> Requirement:
    """``dist``'s own requirement on ``name`` (from its installed metadata), with no extra."""
    for text in importlib.metadata.requires(dist) or []:
        requirement = Requirement(text)
        if requirement.name == name and "extra" not in str(requirement.marker or ""):
            return requirement
    raise LookupError(f"{dist} declares no requirement on {name}")


def problems(admits: tuple[str, ...]) -> list[str]:
    """What is wrong with this environment's install of cula-runtime, as sentences (empty when all is well)."""
    from cula_runtime import cute

    found = []
    for name in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        try:
            requirement = declared("cula-runtime", name)
        except LookupError as exc:
            found.append(str(exc))
            continue
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} was not installed with cula-runtime (it declares {requirement})")
            continue
        if not requirement.specifier.contains(Version(installed), prereleases=True):
            found.append(f"{name} {installed} is outside cula-runtime's range {requirement.specifier}")
        if name == "nvidia-cutlass-dsl":
            found += [f"cula-runtime's range {requirement.specifier} does not admit {name} {version}"
                      for version in admits if not requirement.specifier.contains(Version(version))]
    if not cute.is_available():
        found.append(f"cula_runtime.cute.is_available() is False: {cute.unavailable_reason()}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admits", action="append", default=None,
                        help=f"a CuTeDSL version the declared range must admit (default: {', '.join(TESTED_ENDS)})")
    options = parser.parse_args(argv)
    admits = tuple(options.admits or TESTED_ENDS)
    found = problems(admits)
    for problem in found:
        print(f"check_install: {problem}")
    if found:
        return 1
    versions = {name: importlib.metadata.version(name) for name in ("nvidia-cutlass-dsl", "apache-tvm-ffi")}
    print(f"check_install: OK: {versions}; the declared CuTeDSL range admits {', '.join(admits)}; "
          "cula_runtime.cute.is_available() is True")
    return 0


if __name__ == "__main__":
    sys.exit(main())
