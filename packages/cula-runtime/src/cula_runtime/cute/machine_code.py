"""Machine code of a compiled CuTeDSL kernel: its SASS (via ``nvdisasm``) and the SM its cubin targets.

Tests use this to check what was really built, on a machine without a GPU: that an ``sm_100a`` compile holds
SM100 code, that a warp-MMA kernel has ``HMMA``, that an elementwise kernel uses ``MUFU.EX2``...

``nvdisasm`` comes from the ``nvidia-cuda-nvdisasm`` wheel (a dependency of ``nvidia-cutlass-dsl``); a CUDA
toolkit's ``nvdisasm`` (``$CUDA_HOME/bin`` or ``PATH``) is used when the wheel is absent.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import tempfile
from typing import Any

__all__ = ["MachineCode", "cubin_bytes", "cubin_target", "disassemble", "nvdisasm_path"]

_ELF_MAGIC = b"\x7fELF"
_EM_CUDA = 190
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class MachineCode:
    """Disassembly of one cubin.

    Attributes:
        sm: the SM the code is for, as nvdisasm spells it: ``"SM90"``, ``"SM100"``, ``"SM103"``.
        target: the compile target: ``"sm_90a"`` (arch-specific) or ``"sm_90"``.
        sass: ``nvdisasm -c`` text (code sections only).
    """

    sm: str
    target: str
    sass: str

    @functools.cached_property
    def opcodes(self) -> collections.Counter[str]:
        """How often each full opcode (``"MUFU.EX2"``, ``"LDG.E.128"``...) occurs."""
        return collections.Counter(_OPCODE.findall(self.sass))

    def count(self, prefix: str) -> int:
        """Instructions whose opcode is ``prefix`` or starts with ``prefix.`` (``count("LDG")`` counts every LDG)."""
        return sum(n for op, n in self.opcodes.items() if op == prefix or op.startswith(prefix + "."))


def cubin_bytes(compiled: Any) -> bytes:
    """The cubin of a compiled kernel (or ``compiled`` itself when it already is cubin bytes).

    :func:`cula_runtime.cute.compile_cache.compile_kernel` compiles with ``--keep-cubin``, which makes CuTeDSL keep
    the cubin in ``compiled.__cubin__``.
    """
    data = compiled if isinstance(compiled, (bytes, bytearray)) else getattr(compiled, "__cubin__", None)
    if not isinstance(data, (bytes, bytearray)) or not bytes(data[:4]) == _ELF_MAGIC:
        raise ValueError(
            "no cubin: pass cubin bytes or a kernel compiled by cula_runtime.cute.compile_cache.compile_kernel "
            "(cute.compile with --keep-cubin)"
        )
    return bytes(data)


def cubin_target(cubin: bytes) -> tuple[int, bool]:
    """``(sm, arch_specific)`` from a cubin's ELF header: ``(90, True)`` for sm_90a, ``(100, True)`` for sm_100a.

    CUDA ELF ABI version 7 (up to SM90) keeps the SM in the low byte of ``e_flags`` and marks "a" targets with
    ``0x800``; ABI version 8 (SM100 on) keeps it in the second byte and marks "a" with ``0x8``.
    """
    if len(cubin) < 52 or cubin[:4] != _ELF_MAGIC or struct.unpack_from("<H", cubin, 18)[0] != _EM_CUDA:
        raise ValueError("not a CUDA ELF (cubin)")
    abi_version = cubin[8]
    flags = struct.unpack_from("<I", cubin, 48)[0]
    if abi_version < 8:
        return flags & 0xFF, bool(flags & 0x800)
    return (flags >> 8) & 0xFF, bool(flags & 0x8)


@functools.lru_cache(maxsize=1)
def nvdisasm_path() -> str:
    """Path of ``nvdisasm``: the ``nvidia-cuda-nvdisasm`` wheel's, else ``$CUDA_HOME/bin``, else ``PATH``.

    Raises:
        FileNotFoundError: none found (the message says how to get one).
    """
    spec = importlib.util.find_spec("nvidia")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        for candidate in sorted(glob.glob(os.path.join(root, "cu*", "bin", "nvdisasm")), reverse=True):
            if os.access(candidate, os.X_OK):
                return candidate
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvdisasm"), os.X_OK):
            return os.path.join(home, "bin", "nvdisasm")
    found = shutil.which("nvdisasm")
    if found:
        return found
    raise FileNotFoundError('nvdisasm not found: pip install nvidia-cuda-nvdisasm (or "cula-runtime[cute]")')


def disassemble(compiled: Any) -> MachineCode:
    """SASS and target of a compiled kernel (or of cubin bytes)."""
    cubin = cubin_bytes(compiled)
    sm, arch_specific = cubin_target(cubin)
    with tempfile.TemporaryDirectory(prefix="cula-sass-") as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        result = subprocess.run([nvdisasm_path(), "-c", path], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({result.returncode}): {result.stderr.strip()}")
    return MachineCode(sm=f"SM{sm}", target=f"sm_{sm}{'a' if arch_specific else ''}", sass=result.stdout)
