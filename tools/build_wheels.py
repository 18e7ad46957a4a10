"""Build cuLA's wheels into one folder, each from a clean copy of its package's sources.

Building from a copy keeps the source tree untouched (setuptools would otherwise leave ``build/`` and
``*.egg-info`` there, and a stale ``build/lib`` can put deleted modules into the next wheel). Used by
``nox -s wheel`` / ``nox -s wheel_inspect`` and by tests/packaging/test_wheels.py.

    python tools/build_wheels.py --dest dist packages/cula-runtime packages/cula [packages/cula-sm90]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PURE_PACKAGES = ("packages/cula-runtime", "packages/cula")
SM90_PACKAGE = "packages/cula-sm90"

# What never belongs in a build's input: earlier builds' outputs and caches.
_IGNORED = shutil.ignore_patterns("build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".nox", "_skbuild")


def build_wheels(package_dirs: Sequence[str | Path], dest: str | Path, *, python: str = sys.executable) -> list[Path]:
    """Build one wheel per package directory into ``dest`` with ``pip wheel --no-deps``; return the new wheels."""
    dest = Path(dest).resolve()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cula-build-") as scratch:
        out = Path(scratch) / "wheels"
        copies = []
        for package_dir in package_dirs:
            source = Path(package_dir)
            if not source.is_absolute():
                source = REPO_ROOT / source
            if not (source / "pyproject.toml").is_file():
                raise FileNotFoundError(f"{source} is not a package directory (no pyproject.toml)")
            copy = Path(scratch) / source.name
            shutil.copytree(source, copy, ignore=_IGNORED)
            copies.append(str(copy))
        command = [python, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(out), *copies]
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True)
        built = []
        for wheel in sorted(out.glob("*.whl")):
            target = dest / wheel.name
            target.unlink(missing_ok=True)
            shutil.move(wheel, target)
            built.append(target)
    return built


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("packages", nargs="*", default=list(PURE_PACKAGES), help="package directories")
    parser.add_argument("--dest", default="dist", help="folder for the wheels (default: dist)")
    parser.add_argument("--clean", action="store_true", help="empty the destination folder first")
    args = parser.parse_args(argv)
    if args.clean:
        shutil.rmtree(args.dest, ignore_errors=True)
    for wheel in build_wheels(args.packages, args.dest):
        print(f"built {wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
