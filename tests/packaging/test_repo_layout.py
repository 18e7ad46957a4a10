"""REPO_LAYOUT.md names only paths that exist, and every top-level package folder is described there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = (ROOT / "REPO_LAYOUT.md").read_text()
PATH_PATTERN = re.compile(r"`((?:packages|tests|benchmarks|tools|constraints|docs|\.github|\.ci)/[A-Za-z0-9_./-]*)`")


def test_every_named_path_exists() -> None:
    named = set(PATH_PATTERN.findall(LAYOUT))
    assert len(named) > 20
    missing = sorted(p for p in named if not (ROOT / p.rstrip("/")).exists())
    assert not missing, f"REPO_LAYOUT.md names paths that do not exist: {missing}"


def test_every_package_and_test_folder_is_described() -> None:
    folders = [p for p in (ROOT / "packages").iterdir() if p.is_dir()]
    folders += [p for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith(("__", "."))]
    for folder in folders:
        relative = folder.relative_to(ROOT).as_posix() + "/"
        assert f"`{relative}" in LAYOUT, f"{relative} is not described in REPO_LAYOUT.md"
