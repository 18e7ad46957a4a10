"""``import cula``'s registration with FLA, where FLA may be absent (:mod:`cula.integrations`): without FLA it
installs nothing and imports nothing of FLA; the post-import hook it installs where FLA is present runs its callback
right after the watched module has run, with the module complete, puts the module's own loader back and removes
itself. (With FLA installed, ``tests/integrations/test_fla_backend.py`` checks the real registration.)"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cula import integrations
from cula.integrations import _AfterImport


def test_without_fla_import_cula_installs_no_hook_and_imports_no_fla() -> None:
    code = textwrap.dedent(
        """
        import importlib.util, sys
        if importlib.util.find_spec("fla") is not None:
            print("fla-installed")
        else:
            import cula
            hooks = [f for f in sys.meta_path if type(f).__name__ == "_AfterImport"]
            assert not hooks, hooks
            assert not [m for m in sys.modules if m.split(".")[0] == "fla"]
            print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    if result.stdout.strip() == "fla-installed":
        pytest.skip("FLA is installed here (the hook is then installed: tests/integrations checks it)")
    assert result.stdout.strip() == "ok"


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A throwaway package ``cula_hook_probe`` with a submodule ``ops`` on sys.path."""
    root = tmp_path / "cula_hook_probe"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "ops.py").write_text("VALUE = 41\nVALUE += 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "cula_hook_probe.ops"
    for name in ("cula_hook_probe.ops", "cula_hook_probe"):
        sys.modules.pop(name, None)


def test_the_hook_runs_its_callback_after_the_module_ran_and_removes_itself(package: str,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    hook = _AfterImport(package, lambda: seen.append(sys.modules[package].VALUE))
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    importlib.import_module("cula_hook_probe")
    assert seen == [] and hook in sys.meta_path  # (the parent package is not the watched module)
    module = importlib.import_module(package)
    assert seen == [42] and module.VALUE == 42
    assert hook not in sys.meta_path
    assert type(module.__loader__).__name__ == "SourceFileLoader" and module.__spec__.loader is module.__loader__
    assert module.__loader__.get_source(package).startswith("VALUE = 41")


def test_a_module_that_fails_to_import_runs_no_callback(package: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cula_hook_probe" / "ops.py").write_text("raise RuntimeError('broken module')\n")
    seen = []
    monkeypatch.setattr(sys, "meta_path", [_AfterImport(package, lambda: seen.append(1)), *sys.meta_path])
    with pytest.raises(RuntimeError, match="broken module"):
        importlib.import_module(package)
    assert seen == []


def test_autoregister_treats_a_refused_fla_lookup_as_no_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finder that refuses ``fla`` (as the light-import probe's does) is no FLA: no hook, no error."""

    class Refuse:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "fla":
                raise ImportError("blocked")
            return None

    monkeypatch.setattr(sys, "meta_path", [Refuse(), *(f for f in sys.meta_path if not isinstance(f, _AfterImport))])
    monkeypatch.delitem(sys.modules, integrations.FLA_KDA_MODULE, raising=False)
    integrations.autoregister_fla()
    assert not any(isinstance(f, _AfterImport) for f in sys.meta_path)
