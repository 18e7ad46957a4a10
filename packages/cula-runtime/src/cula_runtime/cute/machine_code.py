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

__all__ = ["MachineCode", "cubin_bytes", "cubin_sm", "disassemble", "nvdisasm_path"]

_ELF_MAGIC = b"\x7fELF"
_EM_CUDA = 190
_TARGET_LINE = re.compile(r"^\s*\.target\s+(sm_\d+[af]?)\s*$", re.MULTILINE)
_HEADER_FLAGS = re.compile(r'^\s*\.headerflags\s+@"([^"]*)"', re.MULTILINE)
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


def cubin_sm(cubin: bytes) -> int:
    """The SM number a cubin's ELF header names: 90, 100, 103...

    CUDA ELF ABI version 7 (older toolchains, up to SM90) keeps it in the low byte of ``e_flags``; ABI version 8
    keeps it in the second byte. (Whether the target is arch-specific, the "a", is encoded differently by different
    ptxas versions; :func:`disassemble` takes it from nvdisasm's header instead.)
    """
    if len(cubin) < 52 or cubin[:4] != _ELF_MAGIC or struct.unpack_from("<H", cubin, 18)[0] != _EM_CUDA:
        raise ValueError("not a CUDA ELF (cubin)")
    flags = struct.unpack_from("<I", cubin, 48)[0]
    return flags & 0xFF if cubin[8] < 8 else (flags >> 8) & 0xFF


def _header_target(text: str) -> str:
    """The compile target from nvdisasm's header: ``.target sm_100a`` (ABI 8) or ``.headerflags`` (ABI 7)."""
    match = _TARGET_LINE.search(text)
    if match:
        return match.group(1)
    match = _HEADER_FLAGS.search(text)
    sm = re.search(r"\bEF_CUDA_SM(\d+)\b", match.group(1)) if match else None
    if sm is None:
        raise RuntimeError("nvdisasm printed neither a .target nor an EF_CUDA_SM header flag")
    return f"sm_{sm.group(1)}{'a' if 'EF_CUDA_ACCELERATORS' in match.group(1) else ''}"


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
    raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm (CI's compile sessions do)")


def disassemble(compiled: Any) -> MachineCode:
    """SASS and target of a compiled kernel (or of cubin bytes).

    Raises:
        RuntimeError: nvdisasm fails, or its header disagrees with the ELF header about the SM.
    """
    cubin = cubin_bytes(compiled)
    sm = cubin_sm(cubin)
    with tempfile.TemporaryDirectory(prefix="cula-sass-") as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        result = subprocess.run([nvdisasm_path(), "-c", path], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"nvdisasm failed ({result.returncode}): {result.stderr.strip()}")
    target = _header_target(result.stdout)
    if not re.fullmatch(rf"sm_{sm}[af]?", target):
        raise RuntimeError(f"the ELF header says SM{sm} but nvdisasm says {target}")
    return MachineCode(sm=f"SM{sm}", target=target, sass=result.stdout)
