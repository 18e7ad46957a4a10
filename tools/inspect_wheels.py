"""Check cuLA's wheels before they ship.

    python tools/inspect_wheels.py dist/ [--require-sm90] [--cuobjdump PATH]

For each of ``cula-runtime`` and ``cula`` (both required in the folder):
  * the tag is ``py3-none-any`` and ``Root-Is-Purelib: true``;
  * no native or CUDA source file (.so, .pyd, .cubin, .fatbin, .cu, .cpp, .h, ...);
  * the file set is exactly the package's files under ``packages/<dist>/src/<import>/`` plus the
    dist-info: no tests, no stray top-level package, nothing missing;
  * ``Requires-Dist`` and ``Provides-Extra`` are exactly the expected ones, with the sibling pins equal to
    the wheel's version.
For ``cula-sm90`` (when present; ``--require-sm90`` makes it required):
  * a CPython tag ``cp3XX-cp3XX-<linux platform>`` and ``Root-Is-Purelib: false``;
  * exactly one extension, ``cula_sm90/_C.cpython-3XX-*.so`` for that same CPython, plus the shim files;
  * the extension needs only the C/C++ runtime libraries (no libtorch, libpython or libcudart);
  * its device code is sm_90a machine code only (``cuobjdump --list-elf`` / ``--list-ptx``, from the
    ``nvidia-cuda-cuobjdump`` wheel or PATH), no kernel uses local memory (``-res-usage``), each KDA kernel
    has the 16-byte global stores its source writes (``-sass``, WIDE_STORES), and the recurrence kernels are
    exactly those of RECURRENCE_BLOCKS;
  * it loads in this interpreter without importing torch and reports the wheel's version and ["sm_90a"]; bad
    kda_intra / kda_recurrence arguments (a retired intra form, the retired V block 32) are ValueErrors.
All wheels must have one version. Exit status 1 when any check fails; the report says which.

The checks are functions, also used by tests/packaging/test_wheels.py: each returns a list of problems.
"""

from __future__ import annotations

import argparse
import email.message
import email.parser
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parent.parent

# dist name -> (package folder, import name)
PURE_DISTS = {
    "cula-runtime": ("packages/cula-runtime", "cula_runtime"),
    "cula": ("packages/cula", "cula"),
}
SM90_DIST = "cula-sm90"
SM90_PACKAGE = ("packages/cula-sm90", "cula_sm90")
SM90_ARCH = "sm_90a"

# Files that must never be in a pure wheel (and, but for the one extension, in the sm90 wheel).
NATIVE_SUFFIXES = frozenset(
    {".so", ".pyd", ".dll", ".dylib", ".o", ".a", ".lib", ".cubin", ".fatbin", ".ptx"}
    | {".cu", ".cuh", ".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".hxx", ".inl"}
)
# dist-info files a wheel has; OPTIONAL ones may be there.
DIST_INFO_REQUIRED = frozenset({"METADATA", "WHEEL", "RECORD"})
DIST_INFO_OPTIONAL = frozenset({"top_level.txt", "entry_points.txt"})

# The expected Requires-Dist of each wheel, ``{version}`` standing for the wheel's own version. The torch
# floor and the CuTeDSL range are the same as in the packages' pyproject.toml (and, for CuTeDSL, as
# cula_runtime.cute.DSL_REQUIREMENTS); change them together. CuTeDSL comes wherever NVIDIA ships it.
TORCH = "torch>=2.9.1"
CUTEDSL_MARKER = 'sys_platform == "linux" and (platform_machine == "x86_64" or platform_machine == "aarch64")'
EXPECTED_REQUIREMENTS = {
    "cula-runtime": {
        TORCH, f"nvidia-cutlass-dsl>=4.6.2,<=4.8.1; {CUTEDSL_MARKER}", f"apache-tvm-ffi<0.2,>=0.1.11; {CUTEDSL_MARKER}"
    },
    "cula": {
        TORCH,
        "cula-runtime=={version}",
        'cula-sm90=={version}; extra == "sm90"',
        'cula-runtime[cute]=={version}; extra == "cute"',
    },
    "cula-sm90": {TORCH, "cula-runtime=={version}"},
}
EXPECTED_EXTRAS = {"cula-runtime": {"cute"}, "cula": {"sm90", "cute"}, "cula-sm90": set()}

# Libraries the sm90 extension may need at run time: the C and C++ runtimes, nothing else. The CUDA
# runtime is linked statically (it opens the driver, libcuda.so.1, itself); libtorch and libpython never.
ALLOWED_NEEDED = frozenset(
    {
        "libc.so.6",
        "libm.so.6",
        "libdl.so.2",
        "librt.so.1",
        "libpthread.so.0",
        "libstdc++.so.6",
        "libgcc_s.so.1",
        "ld-linux-x86-64.so.2",
        "ld-linux-aarch64.so.1",
    }
)

# cuobjdump's device-code listing of an extension: the archs of its cubins (ELF) and of its PTX, and the kernels
# that use local memory (register spills or a stack: the KDA kernels are built to have none).
DeviceCodeLister = Callable[[Path], "DeviceCode"]


@dataclass(frozen=True)
class DeviceCode:
    elf_archs: tuple[str, ...]
    ptx_archs: tuple[str, ...]
    local_memory: tuple[str, ...] = ()
    narrow_stores: tuple[str, ...] = ()  # kernels with fewer 16-byte global stores than their source writes
    kernels: tuple[str, ...] = ()  # every kernel's mangled name (the -sass listing); () when not listed


# The 16-byte global stores (SASS STG.E.128) each KDA kernel's source writes per work item, by a substring of the
# kernel's mangled name: the recurrence's four o rows per chunk; the intra kernel's w/u rows (8) and Aqk rows (2).
# nvcc may split a 16-byte store into four 4-byte ones where it cannot prove the alignment (it did for the
# recurrence's o rows before ptx::st_global_u4: 10-18% of that kernel's time on the H200), so the wheel check counts
# them in the machine code.
WIDE_STORES = {"kda_recurrence_kernel": 4, "kda_intra_kernel": 10}
# The V blocks the recurrence kernel is built for (kda_recurrence_kernel<kBV>): whole warpgroups only, the blocks the
# shim accepts (cula_runtime.kda_tuning.BLOCK_V_CHOICES); the mma.sync kernel at 32 was retired in issue 25.
RECURRENCE_BLOCKS = (64, 128)


def sass_kernels(sass: str) -> tuple[str, ...]:
    """The kernels of a ``cuobjdump -sass`` listing, by mangled name, in listing order."""
    return tuple(re.findall(r"^\s*Function : (\S+)", sass, flags=re.MULTILINE))


def recurrence_blocks(kernels: Iterable[str]) -> tuple[int, ...]:
    """The V blocks of the ``kda_recurrence_kernel<kBV>`` instantiations among mangled kernel names, sorted."""
    return tuple(sorted(int(m.group(1)) for k in kernels if (m := re.search(r"kda_recurrence_kernelILi(\d+)EE", k))))


def narrow_store_kernels(sass: str) -> tuple[str, ...]:
    """The kernels of a ``cuobjdump -sass`` listing that have fewer STG.E.128 than WIDE_STORES expects of them."""
    counts: dict[str, int] = {}
    name = None
    for line in sass.splitlines():
        header = re.match(r"\s*Function : (\S+)", line)
        if header:
            name = header.group(1)
            counts[name] = 0
        elif name is not None and re.search(r"\bSTG\.E\.128\b", line):
            counts[name] += 1
    return tuple(
        name for name, count in counts.items()
        if any(key in name and count < least for key, least in WIDE_STORES.items())
    )


@dataclass
class WheelReport:
    wheel: Path
    problems: list[str]
    notes: list[str]


# ---------------------------------------------------------------------------------------------------
# Reading wheels


@dataclass(frozen=True)
class WheelContents:
    dist: str
    version: str
    tags: tuple[str, ...]  # "py3-none-any", ...
    files: frozenset[str]
    dist_info: str  # "<name>-<version>.dist-info"
    metadata: email.message.Message
    wheel_info: email.message.Message


def read_wheel(path: Path) -> WheelContents:
    """Read a wheel's name, tags, file list and dist-info. Raises ValueError for a malformed wheel."""
    name, version, _build, tags = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as archive:
        files = frozenset(n for n in archive.namelist() if not n.endswith("/"))
        dist_infos = {n.split("/", 1)[0] for n in files if n.split("/", 1)[0].endswith(".dist-info")}
        if len(dist_infos) != 1:
            raise ValueError(f"{path.name}: expected one .dist-info folder, found {sorted(dist_infos) or 'none'}")
        (dist_info,) = dist_infos
        try:
            metadata = email.parser.BytesParser().parsebytes(archive.read(f"{dist_info}/METADATA"))
            wheel_info = email.parser.BytesParser().parsebytes(archive.read(f"{dist_info}/WHEEL"))
        except KeyError as missing:
            raise ValueError(f"{path.name}: {missing.args[0]} is missing") from None
    return WheelContents(
        dist=str(name),
        version=str(version),
        tags=tuple(sorted(str(tag) for tag in tags)),
        files=files,
        dist_info=dist_info,
        metadata=metadata,
        wheel_info=wheel_info,
    )


def source_package_files(package_dir: Path, import_name: str) -> set[str]:
    """The files a wheel must carry for ``src/<import_name>``: everything but caches and hidden files."""
    root = package_dir / "src" / import_name
    if not root.is_dir():
        raise FileNotFoundError(f"{root} does not exist")
    expected = set()
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if not path.is_file() or path.suffix == ".pyc" or "__pycache__" in relative.parts:
            continue
        if any(part.startswith(".") for part in relative.parts):
            continue
        expected.add(f"{import_name}/{relative.as_posix()}")
    return expected


# ---------------------------------------------------------------------------------------------------
# Checks shared by every wheel


def _requirement_key(text: str) -> tuple[str, tuple[str, ...], str, str]:
    requirement = Requirement(text)
    return (
        canonicalize_name(requirement.name),
        tuple(sorted(requirement.extras)),
        str(requirement.specifier),  # packaging sorts the clauses
        str(requirement.marker) if requirement.marker else "",
    )


def check_metadata(contents: WheelContents) -> list[str]:
    """Name/version agree with the file name; Requires-Dist and Provides-Extra are exactly as expected."""
    problems = []
    dist = canonicalize_name(contents.dist)
    meta_name = canonicalize_name(contents.metadata.get("Name", ""))
    if meta_name != dist:
        problems.append(f"METADATA Name is {meta_name!r}, the file name says {dist!r}")
    if contents.metadata.get("Version") != contents.version:
        meta_version = contents.metadata.get("Version")
        problems.append(f"METADATA Version is {meta_version!r}, the file name says {contents.version}")
    if dist not in EXPECTED_REQUIREMENTS:
        return [*problems, f"{dist} is not one of cuLA's wheels ({', '.join(EXPECTED_REQUIREMENTS)})"]

    expected = {_requirement_key(r.format(version=contents.version)) for r in EXPECTED_REQUIREMENTS[dist]}
    found = set()
    for text in contents.metadata.get_all("Requires-Dist") or []:
        try:
            found.add(_requirement_key(text))
        except ValueError as error:
            problems.append(f"unparsable Requires-Dist {text!r}: {error}")

    def show(keys: Iterable[tuple[str, tuple[str, ...], str, str]]) -> str:
        parts = []
        for name, extras, spec, marker in sorted(keys):
            extra = f"[{','.join(extras)}]" if extras else ""
            parts.append(f"{name}{extra}{spec}" + (f"; {marker}" if marker else ""))
        return ", ".join(parts)

    if found - expected:
        problems.append(f"unexpected Requires-Dist: {show(found - expected)}")
    if expected - found:
        problems.append(f"missing Requires-Dist: {show(expected - found)}")
    extras = {canonicalize_name(e) for e in contents.metadata.get_all("Provides-Extra") or []}
    if extras != EXPECTED_EXTRAS[dist]:
        problems.append(f"Provides-Extra is {sorted(extras)}, expected {sorted(EXPECTED_EXTRAS[dist])}")
    return problems


def check_dist_info(contents: WheelContents) -> list[str]:
    """The dist-info folder holds the wheel's own files only, and WHEEL's tags match the file name."""
    problems = []
    names = {f.split("/", 1)[1] for f in contents.files if f.startswith(contents.dist_info + "/")}
    for missing in sorted(DIST_INFO_REQUIRED - names):
        problems.append(f"{contents.dist_info}/{missing} is missing")
    for extra in sorted(names - DIST_INFO_REQUIRED - DIST_INFO_OPTIONAL):
        if not extra.startswith("licenses/"):
            problems.append(f"unexpected file {contents.dist_info}/{extra}")
    wheel_tags = tuple(sorted(contents.wheel_info.get_all("Tag") or []))
    if wheel_tags != contents.tags:
        problems.append(f"WHEEL says Tag {list(wheel_tags)}, the file name says {list(contents.tags)}")
    return problems


def _compare_files(found: Iterable[str], expected: Iterable[str]) -> list[str]:
    found, expected = set(found), set(expected)
    problems = [f"unexpected file {name}" for name in sorted(found - expected)]
    problems += [f"missing file {name}" for name in sorted(expected - found)]
    return problems


# ---------------------------------------------------------------------------------------------------
# Pure wheels: cula-runtime, cula


def check_pure_wheel(path: Path, source_root: Path = REPO_ROOT) -> list[str]:
    """Every problem with a cula-runtime or cula wheel; an empty list when it is fit to ship."""
    try:
        contents = read_wheel(path)
    except (ValueError, zipfile.BadZipFile) as error:
        return [f"not a readable wheel: {error}"]
    dist = canonicalize_name(contents.dist)
    if dist not in PURE_DISTS:
        return [f"{dist} is not a pure cuLA wheel ({', '.join(PURE_DISTS)})"]
    problems = []
    if contents.tags != ("py3-none-any",):
        problems.append(f"tag is {'.'.join(contents.tags)}, expected py3-none-any (pure Python)")
    if contents.wheel_info.get("Root-Is-Purelib", "").strip().lower() != "true":
        problems.append("WHEEL has no 'Root-Is-Purelib: true'")
    for name in sorted(contents.files):
        if Path(name).suffix.lower() in NATIVE_SUFFIXES:
            problems.append(f"native or CUDA source file {name} in a pure wheel")
    package_dir, import_name = PURE_DISTS[dist]
    expected = source_package_files(source_root / package_dir, import_name)
    payload = {f for f in contents.files if not f.startswith(contents.dist_info + "/")}
    problems += _compare_files(payload, expected)
    problems += check_dist_info(contents)
    problems += check_metadata(contents)
    return problems


# ---------------------------------------------------------------------------------------------------
# The native wheel: cula-sm90

_SM90_TAG = re.compile(r"^cp(?P<py>3\d+)-cp(?P=py)-(?P<platform>(?:many)?linux_?\w+)$")
_EXTENSION = re.compile(r"^cula_sm90/_C\.cpython-(?P<py>3\d+)-[\w-]+\.so$")


def elf_needed(data: bytes) -> list[str]:
    """The DT_NEEDED entries (shared libraries it needs) of a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    (section_offset,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count = struct.unpack_from("<HH", data, 0x3A)
    # Section header: name, type, flags, addr, offset, size, link, info, addralign, entsize.
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    needed = []
    for _name, kind, _flags, _addr, offset, size, link, *_rest in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strings_offset = sections[link][4]
        for entry in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, entry)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strings_offset + value
                needed.append(data[start : data.index(b"\0", start)].decode())
    return needed


def find_cuobjdump() -> str | None:
    """cuobjdump from an installed nvidia-cuda-cuobjdump wheel (nvidia/cu*/bin), else from PATH."""
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels
    except ImportError:
        nvidia = None
    for root in getattr(nvidia, "__path__", []):
        for candidate in sorted(Path(root).glob("cu*/bin/cuobjdump"), reverse=True):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return shutil.which("cuobjdump")


def cuobjdump_lister(cuobjdump: str) -> DeviceCodeLister:
    """A DeviceCodeLister that runs ``cuobjdump --list-elf``, ``--list-ptx``, ``-res-usage`` and ``-sass`` on the
    extension."""

    def archs(option: str, path: Path) -> tuple[str, ...]:
        result = subprocess.run([cuobjdump, option, str(path)], capture_output=True, text=True)
        if "does not contain device code" in result.stdout + result.stderr:
            return ()
        if result.returncode != 0:
            raise RuntimeError(f"{cuobjdump} {option} failed ({result.returncode}): {result.stderr.strip()}")
        # "ELF file    1: _C.cpython-311-x86_64-linux-gnu.1.sm_90a.cubin" / "PTX file    1: ....sm_90a.ptx"
        return tuple(re.findall(r"\.(sm_\d+[a-z]?)\.(?:cubin|ptx)\s*$", result.stdout, flags=re.MULTILINE))

    def local_memory(path: Path) -> tuple[str, ...]:
        # " Function <name>:" then "  REG:255 STACK:0 SHARED:1024 LOCAL:0 ..." per kernel
        result = subprocess.run([cuobjdump, "-res-usage", str(path)], capture_output=True, text=True)
        found = re.findall(r"Function (\S+):\s*\n\s*REG:\d+ STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", result.stdout)
        return tuple(name for name, stack, local in found if int(stack) or int(local))

    def list_device_code(path: Path) -> DeviceCode:
        sass = subprocess.run([cuobjdump, "-sass", str(path)], capture_output=True, text=True).stdout
        return DeviceCode(elf_archs=archs("--list-elf", path), ptx_archs=archs("--list-ptx", path),
                          local_memory=local_memory(path), narrow_stores=narrow_store_kernels(sass),
                          kernels=sass_kernels(sass))

    return list_device_code


def check_extension_binary(data: bytes, name: str, list_device_code: DeviceCodeLister | None) -> list[str]:
    """The sm90 extension's own checks: its libraries, and sm_90a machine code with no PTX."""
    problems = []
    try:
        needed = elf_needed(data)
    except (ValueError, struct.error, IndexError) as error:
        return [f"{name} is not a readable ELF shared object: {error}"]
    for library in needed:
        if library not in ALLOWED_NEEDED:
            why = " (the extension must never link libtorch)" if re.match(r"lib(torch|c10)", library) else ""
            problems.append(f"{name} needs {library}{why}; only the C/C++ runtimes are allowed")
    if list_device_code is None:
        return [*problems, f"cannot check the device code of {name}: no cuobjdump (pip install nvidia-cuda-cuobjdump)"]
    with tempfile.TemporaryDirectory() as scratch:
        extension = Path(scratch) / Path(name).name
        extension.write_bytes(data)
        code = list_device_code(extension)
    if not code.elf_archs:
        problems.append(f"{name} holds no GPU machine code; expected {SM90_ARCH}")
    elif set(code.elf_archs) != {SM90_ARCH}:
        problems.append(f"{name} holds machine code for {sorted(set(code.elf_archs))}; expected {SM90_ARCH} only")
    if code.ptx_archs:
        problems.append(f"{name} holds PTX for {sorted(set(code.ptx_archs))}; expected {SM90_ARCH} machine code only")
    if code.local_memory:
        problems.append(f"{name}: kernels use local memory (register spills or a stack): {list(code.local_memory)}")
    if code.narrow_stores:
        problems.append(f"{name}: kernels with fewer 16-byte global stores (STG.E.128) than their source writes "
                        f"(nvcc split them; see WIDE_STORES): {list(code.narrow_stores)}")
    if code.kernels and recurrence_blocks(code.kernels) != RECURRENCE_BLOCKS:
        problems.append(f"{name}: recurrence kernels for V blocks {list(recurrence_blocks(code.kernels))}; expected "
                        f"exactly {list(RECURRENCE_BLOCKS)} (RECURRENCE_BLOCKS)")
    return problems


def check_sm90_wheel(
    path: Path, source_root: Path = REPO_ROOT, list_device_code: DeviceCodeLister | None = None
) -> list[str]:
    """Every problem with a cula-sm90 wheel; pass a DeviceCodeLister (see cuobjdump_lister) to check the code."""
    try:
        contents = read_wheel(path)
    except (ValueError, zipfile.BadZipFile) as error:
        return [f"not a readable wheel: {error}"]
    if canonicalize_name(contents.dist) != SM90_DIST:
        return [f"{contents.dist} is not {SM90_DIST}"]
    problems = []
    match = _SM90_TAG.match(contents.tags[0]) if len(contents.tags) == 1 else None
    if match is None:
        problems.append(f"tag is {'.'.join(contents.tags)}, expected one cp3XX-cp3XX-<linux platform> tag")
    if contents.wheel_info.get("Root-Is-Purelib", "").strip().lower() != "false":
        problems.append("WHEEL has no 'Root-Is-Purelib: false'")

    payload = {f for f in contents.files if not f.startswith(contents.dist_info + "/")}
    extensions = sorted(f for f in payload if _EXTENSION.match(f))
    if len(extensions) != 1:
        problems.append(f"expected exactly one extension cula_sm90/_C.cpython-3XX-*.so, found {extensions or 'none'}")
    for extension in extensions:
        built_for = _EXTENSION.match(extension)["py"]
        if match is not None and built_for != match["py"]:
            problems.append(f"{extension} is for CPython {built_for}, the tag says cp{match['py']}")
    for name in sorted(payload - set(extensions)):
        if Path(name).suffix.lower() in NATIVE_SUFFIXES:
            problems.append(f"native or source file {name} besides the extension")
    package_dir, import_name = SM90_PACKAGE
    expected = source_package_files(source_root / package_dir, import_name)
    problems += _compare_files(payload - set(extensions), expected)
    problems += check_dist_info(contents)
    problems += check_metadata(contents)
    if len(extensions) == 1:
        with zipfile.ZipFile(path) as archive:
            data = archive.read(extensions[0])
        problems += check_extension_binary(data, extensions[0], list_device_code)
    return problems


_LOAD_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
import cula_sm90
imported_torch = "torch" in sys.modules
extension = cula_sm90.load_extension()

def refusal(**bad):
    # kda_intra's host checks run before any CUDA call: 100 tokens in 2 chunks, 1 head, null pointers
    args = dict(tuned=11)
    args.update(bad)
    try:
        extension.kda_intra(0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 100, 2, 1, 1, 1.0, -5.0, False, False, False, False,
                            False, 0, 0, 0, 0, 0, 0, args["tuned"], 0)
    except Exception as error:
        return [type(error).__name__, str(error)]
    return None

def recurrence_refusal(block_v):
    # kda_recurrence's host checks run before any CUDA call: 1 sequence, 1 value head, 64 tokens, null pointers
    try:
        extension.kda_recurrence(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1.0, False, block_v, False, 64, 0)
    except Exception as error:
        return [type(error).__name__, str(error)]
    return None

def shim_forms():
    # the shim's intra form names -> codes (cula_sm90/kda.py's _TUNED_FORMS, read from its source: the module imports
    # torch), without "auto" (-1: a per-call choice) and the timing-only "ablate:" forms (never in a wheel)
    import ast, pathlib
    tree = ast.parse(pathlib.Path(cula_sm90.__file__).with_name("kda.py").read_text())
    def value(node):  # int literals joined by | (and a leading -)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return value(node.left) | value(node.right)
        raise ValueError(ast.dump(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["_TUNED_FORMS"]:
            forms = {key.value: value(v) for key, v in zip(node.value.keys, node.value.values)}
            return {name: code for name, code in forms.items() if code >= 0 and not name.startswith("ablate:")}
    return {}

def varlen(bounds):
    # the host-side varlen index build (C++, no CUDA), into an array buffer
    import array
    cu, n = array.array("i", bounds), len(bounds) - 1
    capacity = extension.varlen_launch_capacity(n, bounds[-1], 64)
    out = array.array("i", [-7] * capacity)
    layout = extension.varlen_launch_values(cu.buffer_info()[0], n, 64, out.buffer_info()[0], capacity)
    return [*layout, out.tolist()[:layout[3]]]

print(json.dumps({
    "refusals": {"tuned": refusal(tuned=7), "tuned (retired form 3)": refusal(tuned=3),
                 "block_v (retired 32)": recurrence_refusal(32)},
    "varlen": varlen([0, 100, 100, 228, 240]),
    "forms": {name: [code, extension.intra_form_built(code)] for name, code in shim_forms().items()},
    # form 7 was never built; 0-3 (the earlier forms) were retired in issue 25
    "unbuilt_forms": {code: extension.intra_form_built(code) for code in (0, 1, 2, 3, 7)},
    "shim_version": cula_sm90.__version__,
    "version": extension.version(),
    "archs": extension.compiled_archs(),
    "empty_fill": extension.probe_fill(0, 0, 0.0, 0),
    "extension_file": extension.__file__,
    "imported_torch": imported_torch or "torch" in sys.modules,
}))
"""


# cu = [0, 100, 100, 228, 240], 64-token chunks: (NT, offsets at, order at, size, buffer) = chunk rows (sequence,
# chunk) | pad | chunk offsets | pad | longest first (lengths 100, 0, 128, 12)
_VARLEN_EXPECTED = [5, 12, 20, 24, [0, 0, 0, 1, 2, 0, 2, 1, 3, 0, 0, 0, 0, 2, 2, 4, 5, 0, 0, 0, 2, 0, 3, 1]]
# The intra forms the shim names and the wheel's extension must build (cula_sm90.kda._TUNED_FORMS without "auto",
# a per-call choice between them, and the timing-only "ablate:" forms, never in a wheel; "unbounded" is the form of the
# unbounded-gate calls).
SHIM_INTRA_FORMS = ("tensor", "bands", "unbounded")


def load_check_sm90(path: Path, python: str = sys.executable) -> list[str]:
    """Unpack the wheel and load its extension in ``python`` (needs no GPU): version, archs, refusals of bad
    kda_intra and kda_recurrence arguments (ValueError before any launch), every intra form the shim names built in
    the extension, the host-side varlen index build on one batch, no torch import."""
    with tempfile.TemporaryDirectory() as scratch:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(scratch)
        result = subprocess.run([python, "-s", "-c", _LOAD_PROBE, scratch], capture_output=True, text=True)
        if result.returncode != 0:
            return [f"loading cula_sm90._C failed:\n{result.stderr.strip()}"]
        report = json.loads(result.stdout.strip().splitlines()[-1])
        loaded_from_wheel = Path(report["extension_file"]).resolve().is_relative_to(Path(scratch).resolve())
    problems = [] if loaded_from_wheel else [f"loaded {report['extension_file']}, not the wheel's extension"]
    version = read_wheel(path).version
    if report["version"] != version or report["shim_version"] != version:
        problems.append(f"extension reports {report['version']}, shim {report['shim_version']}, wheel {version}")
    if report["archs"] != [SM90_ARCH]:
        problems.append(f"compiled_archs() is {report['archs']}, expected [{SM90_ARCH!r}]")
    if report["empty_fill"] != 0:
        problems.append(f"probe_fill of 0 elements returned {report['empty_fill']}, expected 0")
    if report["imported_torch"]:
        problems.append("importing cula_sm90 and its extension imported torch")
    if report["varlen"] != _VARLEN_EXPECTED:
        problems.append(f"varlen_launch_values of cu = [0, 100, 100, 228, 240] gave {report['varlen']}, expected "
                        f"{_VARLEN_EXPECTED}")
    # every intra form the shim names has a kernel in the extension (the extension's one list, beside its launcher):
    # "tensor" and "bands"; none for the codes that name no form (0-3 retired, 7 never built)
    if set(report["forms"]) != set(SHIM_INTRA_FORMS) or any(report["unbuilt_forms"].values()):
        problems.append(f"intra forms: the shim names {report['forms']} (expected {sorted(SHIM_INTRA_FORMS)}), codes "
                        f"built of {report['unbuilt_forms']} (expected none)")
    problems += [f"the shim's intra form {name!r} (code {code}) has no kernel in the extension"
                 for name, (code, built) in report["forms"].items() if not built]
    for argument, refused in report["refusals"].items():  # bad arguments: ValueErrors before any launch
        entry = "kda_recurrence" if argument.startswith("block_v") else "kda_intra"
        if refused is None or refused[0] != "ValueError" or f"{argument.split()[0]} must be" not in refused[1]:
            problems.append(f"{entry} with a bad {argument} gave {refused}, expected a ValueError naming it")
    return problems


# ---------------------------------------------------------------------------------------------------
# A folder of wheels


def inspect_folder(
    folder: Path,
    *,
    source_root: Path = REPO_ROOT,
    require_sm90: bool = False,
    list_device_code: DeviceCodeLister | None = None,
    load_check: bool = True,
) -> list[WheelReport]:
    """Check every wheel in ``folder``; a report with the path ``folder`` holds problems of the set."""
    reports = []
    found: dict[str, list[Path]] = {}
    set_problems = []
    for path in sorted(folder.iterdir()):
        if path.suffix != ".whl":
            set_problems.append(f"unexpected file {path.name} (only wheels belong here)")
            continue
        try:
            dist = canonicalize_name(parse_wheel_filename(path.name)[0])
        except ValueError as error:
            set_problems.append(f"{path.name}: {error}")
            continue
        found.setdefault(dist, []).append(path)
    for dist in [*PURE_DISTS, SM90_DIST]:
        paths = found.pop(dist, [])
        if len(paths) > 1:
            set_problems.append(f"{len(paths)} {dist} wheels: {[p.name for p in paths]}; clean the folder first")
        if not paths:
            if dist in PURE_DISTS or require_sm90:
                set_problems.append(f"no {dist} wheel")
            continue
        for path in paths:
            if dist == SM90_DIST:
                problems = check_sm90_wheel(path, source_root, list_device_code)
                notes = []
                if load_check and not problems:
                    tag = str(next(iter(parse_wheel_filename(path.name)[3])))
                    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
                    if tag.startswith(f"{here}-"):
                        problems += load_check_sm90(path)
                        notes.append(f"loaded in {sys.executable} (no GPU needed): version, archs, kda_intra and "
                                     "kda_recurrence argument refusals, the shim's intra forms built, the varlen "
                                     "index build, no torch import")
                    else:
                        notes.append(f"not loaded: built for {tag.split('-')[0]}, this interpreter is {here}")
                reports.append(WheelReport(path, problems, notes))
            else:
                reports.append(WheelReport(path, check_pure_wheel(path, source_root), []))
    for dist, paths in sorted(found.items()):
        set_problems.append(f"unexpected wheel(s) of {dist}: {[p.name for p in paths]}")
    versions = {str(parse_wheel_filename(r.wheel.name)[1]) for r in reports}
    if len(versions) > 1:
        set_problems.append(f"the wheels have different versions: {sorted(versions, key=Version)}")
    reports.append(WheelReport(folder, set_problems, []))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check cuLA's wheels (see the module docstring).")
    parser.add_argument("folder", type=Path, help="folder holding the wheels, e.g. dist/")
    parser.add_argument("--require-sm90", action="store_true", help="fail when there is no cula-sm90 wheel")
    parser.add_argument("--cuobjdump", help="cuobjdump to use (default: the nvidia-cuda-cuobjdump wheel, then PATH)")
    parser.add_argument("--no-load-check", action="store_true", help="do not load the sm90 extension")
    parser.add_argument("--source-root", type=Path, default=REPO_ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"inspect_wheels: {args.folder} is not a folder", file=sys.stderr)
        return 2

    cuobjdump = args.cuobjdump or find_cuobjdump()
    *wheel_reports, set_report = inspect_folder(
        args.folder,
        source_root=args.source_root,
        require_sm90=args.require_sm90,
        list_device_code=cuobjdump_lister(cuobjdump) if cuobjdump else None,
        load_check=not args.no_load_check,
    )
    print(f"inspect_wheels: {args.folder.resolve()}" + (f" (device code listed by {cuobjdump})" if cuobjdump else ""))
    for report in wheel_reports:
        print(f"  {report.wheel.name}: {'FAIL' if report.problems else 'ok'}")
        for problem in report.problems:
            print(f"    - {problem}")
        for note in report.notes:
            print(f"    * {note}")
    if not any(canonicalize_name(parse_wheel_filename(r.wheel.name)[0]) == SM90_DIST for r in wheel_reports):
        print(f"  (no {SM90_DIST} wheel: its checks did not run)")
    if set_report.problems:
        print("  the set of wheels: FAIL")
        for problem in set_report.problems:
            print(f"    - {problem}")
    failed = sum(bool(r.problems) for r in wheel_reports)
    ok = not failed and not set_report.problems
    verdict = "OK" if ok else "FAILED"
    print(f"inspect_wheels: {verdict}: {len(wheel_reports) - failed} of {len(wheel_reports)} wheels pass")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
