"""Importing cula, cula.kda and cula.kernels imports nothing heavy and needs no GPU, CuTeDSL, triton or FLA."""

from __future__ import annotations

import subprocess
import sys
import textwrap

HEAVY = ("cutlass", "triton", "fla", "cula_sm90")

_PROBE = textwrap.dedent(
    """
    import sys

    class Block:
        # make the heavy packages unimportable, as on a machine without them
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {heavy!r}:
                raise ImportError(f"blocked for this test: {{name}}")
            return None

    sys.meta_path.insert(0, Block())
    import cula, cula.kda, cula.kernels, cula.kernels.kda, cula.kernels.lightning, cula_runtime
    import torch
    cula.kernels.list_kernels()
    cula_runtime.prepare_chunk_indices(torch.tensor([0, 65], dtype=torch.int32), 64)
    assert callable(cula.kda.kda_prefill)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
    assert not loaded, loaded
    assert not torch.cuda.is_initialized()
    print("ok")
    """
)


def test_import_is_light_in_a_fresh_interpreter() -> None:
    code = _PROBE.format(heavy=set(HEAVY))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_cpu_call_works_with_heavy_packages_blocked() -> None:
    code = _PROBE.format(heavy=set(HEAVY)) + textwrap.dedent(
        """
        q = torch.randn(1, 20, 1, 8); v = torch.randn(1, 20, 1, 8)
        o, _ = cula.kda.kda_prefill(q, q.clone(), v, -torch.rand(1, 20, 1, 8), torch.rand(1, 20, 1))
        assert torch.isfinite(o).all()
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {heavy!r})
        assert not loaded, loaded
        print("ran")
        """
    ).format(heavy=set(HEAVY))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "ran"]
