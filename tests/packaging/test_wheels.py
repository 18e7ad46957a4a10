"""The wheel checker, tools/inspect_wheels.py: it passes cuLA's real pure wheels and rejects broken ones.

The pure wheels are built here from clean copies of the sources (tools/build_wheels.py), or taken from
``$CULA_WHEEL_DIR`` when set. The cula-sm90 wheel takes minutes to build, so its rules are tested on small
fake wheels; the real one is checked by ``nox -s wheel_inspect``.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import shutil
import stat
import struct
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def _load_tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"cula_tools_{name}", ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


inspect_wheels = _load_tool("inspect_wheels")
build_wheels = _load_tool("build_wheels")

VERSION = re.search(r'^__version__ = "([^"]+)"', (ROOT / "packages/cula/src/cula/_version.py").read_text(), re.M)[1]


# ---------------------------------------------------------------------------------------------------
# Wheels made and edited for the tests


def write_wheel(path: Path, files: dict[str, bytes]) -> Path:
    """Write a wheel holding ``files`` plus a RECORD in its (single) dist-info folder."""
    dist_info = next(name.split("/")[0] for name in files if name.split("/")[0].endswith(".dist-info"))
    lines = []
    for name, data in files.items():
        if name != f"{dist_info}/RECORD":
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{name},sha256={digest},{len(data)}")
    lines.append(f"{dist_info}/RECORD,,")
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            if name != f"{dist_info}/RECORD":
                archive.writestr(name, data)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(lines) + "\n")
    return path


def read_files(wheel: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def edited(wheel: Path, out_dir: Path, edit: Callable[[dict[str, bytes]], None], *, name: str | None = None) -> Path:
    """A copy of ``wheel`` (renamed to ``name`` if given) with ``edit`` applied to its files."""
    files = read_files(wheel)
    edit(files)
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_wheel(out_dir / (name or wheel.name), files)


def replace_in(files: dict[str, bytes], member_suffix: str, old: str, new: str) -> None:
    (member,) = [name for name in files if name.endswith(member_suffix)]
    text = files[member].decode()
    assert old in text, f"{old!r} not in {member}"
    files[member] = text.replace(old, new).encode()


def make_elf(needed: list[str]) -> bytes:
    """A minimal 64-bit little-endian ELF shared object whose dynamic section needs ``needed``."""
    strings, offsets = b"\0", []
    for library in needed:
        offsets.append(len(strings))
        strings += library.encode() + b"\0"
    dynamic = b"".join(struct.pack("<qQ", 1, offset) for offset in offsets) + struct.pack("<qQ", 0, 0)
    strings_at = 64
    dynamic_at = (strings_at + len(strings) + 7) // 8 * 8
    sections_at = dynamic_at + len(dynamic)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, sections_at, 0, 64, 0, 0, 64, 3, 0)
    body = strings.ljust(dynamic_at - strings_at, b"\0") + dynamic
    null_section = bytes(64)
    strtab = struct.pack("<IIQQQQIIQQ", 0, 3, 0, 0, strings_at, len(strings), 0, 0, 1, 0)
    dynsec = struct.pack("<IIQQQQIIQQ", 0, 6, 0, 0, dynamic_at, len(dynamic), 1, 0, 8, 16)
    return header + body + null_section + strtab + dynsec


GOOD_NEEDED = ["libstdc++.so.6", "libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2"]
SM90_TAG = "cp311-cp311-linux_x86_64"
SM90_EXTENSION = "cula_sm90/_C.cpython-311-x86_64-linux-gnu.so"


def sm90_files(
    *, tag: str = SM90_TAG, extension: str | None = SM90_EXTENSION, so: bytes | None = None, pure: bool = False
) -> dict[str, bytes]:
    """The files of a well-formed cula-sm90 wheel: the real shim sources and a fake extension."""
    dist_info = f"cula_sm90-{VERSION}.dist-info"
    shim = inspect_wheels.source_package_files(ROOT / "packages/cula-sm90", "cula_sm90")
    files = {name: (ROOT / "packages/cula-sm90/src" / name).read_bytes() for name in sorted(shim)}
    if extension is not None:
        files[extension] = make_elf(GOOD_NEEDED) if so is None else so
    files[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.2\nName: cula-sm90\nVersion: {VERSION}\n"
        f"Requires-Dist: torch>=2.9.1\nRequires-Dist: cula-runtime=={VERSION}\n"
    ).encode()
    files[f"{dist_info}/WHEEL"] = (
        f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: {'true' if pure else 'false'}\nTag: {tag}\n"
    ).encode()
    files[f"{dist_info}/RECORD"] = b""
    return files


def sm90_wheel(out_dir: Path, *, tag: str = SM90_TAG, **kwargs: object) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_wheel(out_dir / f"cula_sm90-{VERSION}-{tag}.whl", sm90_files(tag=tag, **kwargs))


def sm90_code(*elf: str, ptx: tuple[str, ...] = ()) -> Callable[[Path], object]:
    """A stand-in for cuobjdump that reports the given device code."""
    return lambda _path: inspect_wheels.DeviceCode(elf_archs=elf, ptx_archs=ptx)


# ---------------------------------------------------------------------------------------------------
# The real pure wheels


@pytest.fixture(scope="module")
def pure_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """dist name -> wheel for cula-runtime and cula, built now or taken from $CULA_WHEEL_DIR."""
    prebuilt = os.environ.get("CULA_WHEEL_DIR")
    if prebuilt:
        wheels = list(Path(prebuilt).glob("*.whl"))
    else:
        wheels = build_wheels.build_wheels(build_wheels.PURE_PACKAGES, tmp_path_factory.mktemp("wheels"))
    found = {canonicalize_name(inspect_wheels.read_wheel(w).dist): w for w in wheels}
    missing = set(inspect_wheels.PURE_DISTS) - set(found)
    assert not missing, f"no wheel for {sorted(missing)} among {[w.name for w in wheels]}"
    return {dist: found[dist] for dist in inspect_wheels.PURE_DISTS}


@pytest.mark.parametrize("dist", ["cula-runtime", "cula"])
def test_real_pure_wheel_passes(pure_wheels: dict[str, Path], dist: str) -> None:
    assert inspect_wheels.check_pure_wheel(pure_wheels[dist]) == []


def test_real_pure_wheels_are_pure_and_pinned(pure_wheels: dict[str, Path]) -> None:
    runtime = inspect_wheels.read_wheel(pure_wheels["cula-runtime"])
    cula = inspect_wheels.read_wheel(pure_wheels["cula"])
    assert runtime.tags == cula.tags == ("py3-none-any",)
    assert runtime.version == cula.version == VERSION
    assert f"cula-runtime=={VERSION}" in cula.metadata.get_all("Requires-Dist")
    assert not [f for f in runtime.files | cula.files if f.endswith((".so", ".cu", ".cpp", ".h"))]


def test_real_pure_wheels_folder_passes(pure_wheels: dict[str, Path], tmp_path: Path) -> None:
    for wheel in pure_wheels.values():
        shutil.copy(wheel, tmp_path)
    reports = inspect_wheels.inspect_folder(tmp_path)
    assert [(r.wheel.name, r.problems) for r in reports if r.problems] == []
    assert len(reports) == 3  # two wheels and the folder


def test_folder_needs_both_pure_wheels_and_the_sm90_one_when_required(
    pure_wheels: dict[str, Path], tmp_path: Path
) -> None:
    shutil.copy(pure_wheels["cula"], tmp_path)
    (tmp_path / "notes.txt").write_text("stray")
    *_, folder = inspect_wheels.inspect_folder(tmp_path, require_sm90=True)
    assert "no cula-runtime wheel" in folder.problems
    assert "no cula-sm90 wheel" in folder.problems
    assert any("notes.txt" in p for p in folder.problems)


# ---------------------------------------------------------------------------------------------------
# Broken pure wheels are rejected


def _add_native_extension(files: dict[str, bytes]) -> None:
    files["cula/_C.cpython-311-x86_64-linux-gnu.so"] = make_elf(GOOD_NEEDED)


def _add_cuda_source(files: dict[str, bytes]) -> None:
    files["cula/kernel.cu"] = b"__global__ void k() {}\n"


def _add_tests(files: dict[str, bytes]) -> None:
    files["tests/test_cula.py"] = b"def test(): pass\n"


def _drop_version_module(files: dict[str, bytes]) -> None:
    del files["cula/_version.py"]


def _loosen_runtime_pin(files: dict[str, bytes]) -> None:
    replace_in(files, "/METADATA", f"Requires-Dist: cula-runtime=={VERSION}", "Requires-Dist: cula-runtime>=0.1")


def _drop_sm90_extra(files: dict[str, bytes]) -> None:
    replace_in(files, "/METADATA", "Provides-Extra: sm90\n", "")
    replace_in(files, "/METADATA", f'Requires-Dist: cula-sm90=={VERSION}; extra == "sm90"\n', "")


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        pytest.param(_add_native_extension, "native or CUDA source file cula/_C.cpython", id="so-file"),
        pytest.param(_add_cuda_source, "native or CUDA source file cula/kernel.cu", id="cu-file"),
        pytest.param(_add_tests, "unexpected file tests/test_cula.py", id="stray-tests-package"),
        pytest.param(_drop_version_module, "missing file cula/_version.py", id="missing-module"),
        pytest.param(_loosen_runtime_pin, "unexpected Requires-Dist: cula-runtime>=0.1", id="loose-runtime-pin"),
        pytest.param(_drop_sm90_extra, "Provides-Extra is ['cute']", id="no-sm90-extra"),
    ],
)
def test_broken_cula_wheel_is_rejected(
    pure_wheels: dict[str, Path], tmp_path: Path, edit: Callable[[dict[str, bytes]], None], expected: str
) -> None:
    broken = edited(pure_wheels["cula"], tmp_path, edit)
    problems = inspect_wheels.check_pure_wheel(broken)
    assert any(expected in p for p in problems), problems


def test_non_pure_tag_is_rejected(pure_wheels: dict[str, Path], tmp_path: Path) -> None:
    def retag(files: dict[str, bytes]) -> None:
        replace_in(files, "/WHEEL", "Tag: py3-none-any", "Tag: cp311-cp311-linux_x86_64")
        replace_in(files, "/WHEEL", "Root-Is-Purelib: true", "Root-Is-Purelib: false")

    broken = edited(pure_wheels["cula-runtime"], tmp_path, retag, name=f"cula_runtime-{VERSION}-{SM90_TAG}.whl")
    problems = inspect_wheels.check_pure_wheel(broken)
    assert f"tag is {SM90_TAG}, expected py3-none-any (pure Python)" in problems
    assert "WHEEL has no 'Root-Is-Purelib: true'" in problems


def test_wheel_tag_disagreeing_with_file_name_is_rejected(pure_wheels: dict[str, Path], tmp_path: Path) -> None:
    def retag(files: dict[str, bytes]) -> None:
        replace_in(files, "/WHEEL", "Tag: py3-none-any", "Tag: py2.py3-none-any")

    problems = inspect_wheels.check_pure_wheel(edited(pure_wheels["cula-runtime"], tmp_path, retag))
    assert any(p.startswith("WHEEL says Tag") for p in problems), problems


def test_folder_with_mixed_versions_is_rejected(pure_wheels: dict[str, Path], tmp_path: Path) -> None:
    def bump(files: dict[str, bytes]) -> None:
        replace_in(files, "/METADATA", f"Version: {VERSION}", "Version: 9.9.9")

    shutil.copy(pure_wheels["cula"], tmp_path)
    edited(pure_wheels["cula-runtime"], tmp_path, bump, name="cula_runtime-9.9.9-py3-none-any.whl")
    *_, folder = inspect_wheels.inspect_folder(tmp_path)
    assert any("different versions" in p for p in folder.problems), folder.problems


# ---------------------------------------------------------------------------------------------------
# The sm90 rules, on fake wheels


def test_fake_sm90_wheel_that_follows_the_rules_passes(tmp_path: Path) -> None:
    assert inspect_wheels.check_sm90_wheel(sm90_wheel(tmp_path), list_device_code=sm90_code("sm_90a")) == []


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        pytest.param(sm90_code(), "holds no GPU machine code; expected sm_90a", id="no-cubin"),
        pytest.param(sm90_code("sm_80"), "holds machine code for ['sm_80']; expected sm_90a only", id="sm80"),
        pytest.param(sm90_code("sm_90a", "sm_100a"), "['sm_100a', 'sm_90a']; expected sm_90a only", id="extra-arch"),
        pytest.param(sm90_code("sm_90a", ptx=("sm_90a",)), "holds PTX for ['sm_90a']", id="ptx"),
        pytest.param(None, "no cuobjdump (pip install nvidia-cuda-cuobjdump)", id="no-cuobjdump"),
    ],
)
def test_sm90_device_code_must_be_sm90a_cubin_only(tmp_path: Path, code: object, expected: str) -> None:
    problems = inspect_wheels.check_sm90_wheel(sm90_wheel(tmp_path), list_device_code=code)
    assert any(expected in p for p in problems), problems


@pytest.mark.parametrize(
    ("needed", "expected"),
    [
        pytest.param(
            ["libtorch.so", "libc.so.6"], "needs libtorch.so (the extension must never link libtorch)", id="libtorch"
        ),
        pytest.param(["libc10.so"], "needs libc10.so (the extension must never link libtorch)", id="libc10"),
        pytest.param(["libcudart.so.13"], "needs libcudart.so.13; only the C/C++ runtimes", id="shared-cudart"),
        pytest.param(["libpython3.11.so.1.0"], "needs libpython3.11.so.1.0", id="libpython"),
    ],
)
def test_sm90_extension_may_need_only_the_c_and_cpp_runtimes(tmp_path: Path, needed: list[str], expected: str) -> None:
    wheel = sm90_wheel(tmp_path, so=make_elf(needed))
    problems = inspect_wheels.check_sm90_wheel(wheel, list_device_code=sm90_code("sm_90a"))
    assert any(expected in p for p in problems), problems


def test_sm90_extension_linked_against_torch_is_rejected(tmp_path: Path) -> None:
    """A real linker-made ELF: torch's own extension module, which needs libtorch_python.so."""
    torch = pytest.importorskip("torch")
    torch_extension = Path(torch._C.__file__).read_bytes()
    assert "libtorch_python.so" in inspect_wheels.elf_needed(torch_extension)
    wheel = sm90_wheel(tmp_path, so=torch_extension)
    problems = inspect_wheels.check_sm90_wheel(wheel, list_device_code=sm90_code("sm_90a"))
    assert any("needs libtorch_python.so (the extension must never link libtorch)" in p for p in problems), problems


def test_sm90_extension_that_is_not_elf_is_rejected(tmp_path: Path) -> None:
    wheel = sm90_wheel(tmp_path, so=b"not a shared object")
    problems = inspect_wheels.check_sm90_wheel(wheel, list_device_code=sm90_code("sm_90a"))
    assert any("is not a readable ELF shared object" in p for p in problems), problems


def _with(files: dict[str, bytes]) -> Callable[[Path], Path]:
    return lambda tmp_path: write_wheel(tmp_path / f"cula_sm90-{VERSION}-{SM90_TAG}.whl", files)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        pytest.param(
            lambda tmp: sm90_wheel(tmp, extension=None),
            "expected exactly one extension cula_sm90/_C.cpython-3XX-*.so, found none",
            id="no-extension",
        ),
        pytest.param(
            lambda tmp: _with({**sm90_files(), "cula_sm90/_C.cpython-312-x86_64-linux-gnu.so": make_elf([])})(tmp),
            "expected exactly one extension",
            id="two-extensions",
        ),
        pytest.param(
            lambda tmp: sm90_wheel(tmp, extension="cula_sm90/_C.cpython-312-x86_64-linux-gnu.so"),
            "is for CPython 312, the tag says cp311",
            id="extension-for-another-python",
        ),
        pytest.param(
            lambda tmp: _with({**sm90_files(), "cula_sm90/probe_kernel.cu": b"// source\n"})(tmp),
            "native or source file cula_sm90/probe_kernel.cu besides the extension",
            id="cuda-source",
        ),
        pytest.param(
            lambda tmp: _with({**sm90_files(), "cula_sm90/libextra.so": make_elf(GOOD_NEEDED)})(tmp),
            "native or source file cula_sm90/libextra.so besides the extension",
            id="second-shared-object",
        ),
        pytest.param(
            lambda tmp: _with({k: v for k, v in sm90_files().items() if k != "cula_sm90/__init__.py"})(tmp),
            "missing file cula_sm90/__init__.py",
            id="no-shim",
        ),
        pytest.param(
            lambda tmp: sm90_wheel(tmp, tag="py3-none-any", pure=True),
            "tag is py3-none-any, expected one cp3XX-cp3XX-<linux platform> tag",
            id="pure-tag",
        ),
        pytest.param(
            lambda tmp: sm90_wheel(tmp, tag="cp311-abi3-linux_x86_64"),
            "tag is cp311-abi3-linux_x86_64, expected one cp3XX-cp3XX-<linux platform> tag",
            id="abi3-tag",
        ),
        pytest.param(
            lambda tmp: sm90_wheel(tmp, tag="cp311-cp311-win_amd64"),
            "tag is cp311-cp311-win_amd64",
            id="windows-tag",
        ),
    ],
)
def test_malformed_sm90_wheel_is_rejected(tmp_path: Path, make: Callable[[Path], Path], expected: str) -> None:
    problems = inspect_wheels.check_sm90_wheel(make(tmp_path), list_device_code=sm90_code("sm_90a"))
    assert any(expected in p for p in problems), problems


def test_sm90_requirements_are_checked(tmp_path: Path) -> None:
    files = sm90_files()
    replace_in(files, "/METADATA", "Requires-Dist: torch>=2.9.1\n", "Requires-Dist: torch==2.9.1+cu128\n")
    replace_in(files, "/METADATA", f"Requires-Dist: cula-runtime=={VERSION}\n", "")
    problems = inspect_wheels.check_sm90_wheel(_with(files)(tmp_path), list_device_code=sm90_code("sm_90a"))
    assert "unexpected Requires-Dist: torch==2.9.1+cu128" in problems
    assert f"missing Requires-Dist: cula-runtime=={VERSION}, torch>=2.9.1" in problems


# ---------------------------------------------------------------------------------------------------
# The tools the checker relies on


def test_elf_needed_reads_what_make_elf_wrote() -> None:
    assert inspect_wheels.elf_needed(make_elf(["liba.so.1", "libb.so"])) == ["liba.so.1", "libb.so"]
    assert inspect_wheels.elf_needed(make_elf([])) == []
    with pytest.raises(ValueError, match="not an ELF file"):
        inspect_wheels.elf_needed(b"MZ\x90\x00")


def test_cuobjdump_listing_is_parsed(tmp_path: Path) -> None:
    fake = tmp_path / "cuobjdump"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --list-elf) echo 'ELF file    1: _C.cpython-311-x86_64-linux-gnu.1.sm_90a.cubin'\n"
        "              echo 'ELF file    2: _C.cpython-311-x86_64-linux-gnu.2.sm_80.cubin' ;;\n"
        "  --list-ptx) echo \"cuobjdump info    : File '$2' does not contain device code\" >&2; exit 255 ;;\n"
        "esac\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    code = inspect_wheels.cuobjdump_lister(str(fake))(tmp_path / "x.so")
    assert code == inspect_wheels.DeviceCode(elf_archs=("sm_90a", "sm_80"), ptx_archs=())


def test_sass_store_widths_find_narrowed_kernels(tmp_path: Path) -> None:
    """A KDA kernel with fewer 16-byte global stores than its source writes (nvcc split them into 4-byte ones) is
    named, the others are not, kernels outside WIDE_STORES are never named, and the check reports it."""
    sass = (
        "\tcode for sm_90a\n\t\tFunction : _ZN4cula4sm9017recurrence_detail21kda_recurrence_kernelILi64EEEv\n"
        + "        /*0100*/                   STG.E.128 desc[UR4][R2.64], R4 ;\n" * 4
        + "\t\tFunction : _ZN4cula4sm9017recurrence_detail21kda_recurrence_kernelILi128EEEv\n"
        + "        /*0100*/               @P0 STG.E.128 desc[UR4][R2.64], R4 ;\n"
        + "        /*0110*/                   STG.E desc[UR4][R2.64+0x4], R5 ;\n" * 3
        + "\t\tFunction : _ZN4cula4sm9012_GLOBAL__N_116kda_intra_kernelILi11EEEvNS0_14KdaIntraParamsE\n"
        + "        /*0100*/                   STG.E.128 desc[UR4][R2.64], R4 ;\n" * 10
        + "\t\tFunction : probe_kernel\n        /*0100*/                   STG.E desc[UR4][R2.64], R4 ;\n"
    )
    assert inspect_wheels.narrow_store_kernels(sass) == (
        "_ZN4cula4sm9017recurrence_detail21kda_recurrence_kernelILi128EEEv",)
    assert inspect_wheels.narrow_store_kernels(sass.replace("@P0 STG.E.128", "STG.E")) == (
        "_ZN4cula4sm9017recurrence_detail21kda_recurrence_kernelILi128EEEv",)
    fake = tmp_path / "cuobjdump"
    (tmp_path / "sass.txt").write_text(sass)
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --list-elf) echo 'ELF file    1: _C.cpython-311-x86_64-linux-gnu.1.sm_90a.cubin' ;;\n"
        f"  -sass) cat '{tmp_path / 'sass.txt'}' ;;\n"
        "esac\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    lister = inspect_wheels.cuobjdump_lister(str(fake))
    assert lister(tmp_path / "x.so").narrow_stores == (
        "_ZN4cula4sm9017recurrence_detail21kda_recurrence_kernelILi128EEEv",)
    problems = inspect_wheels.check_extension_binary(make_elf([]), "cula_sm90/_C.so", lister)
    assert any("16-byte global stores" in p and "ILi128" in p and "ILi64" not in p for p in problems)


def test_sass_recurrence_kernels_are_the_accepted_blocks(tmp_path: Path) -> None:
    """The extension's recurrence kernels are exactly kda_recurrence_kernel<64> and <128> (RECURRENCE_BLOCKS): a
    listing that still holds the retired <32>, or lacks one, is reported; the kernel names are parsed in order."""
    def listing(*blocks: int) -> str:
        kernel = "_ZN4cula4sm9017recurrence_detail21kda_recurrence_kernelILi{}EEEvNS0_19KdaRecurrenceParamsE"
        return "\tcode for sm_90a\n" + "".join(
            f"\t\tFunction : {kernel.format(bv)}\n"
            + "        /*0100*/                   STG.E.128 desc[UR4][R2.64], R4 ;\n" * 4 for bv in blocks)

    fake = tmp_path / "cuobjdump"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --list-elf) echo 'ELF file    1: _C.cpython-311-x86_64-linux-gnu.1.sm_90a.cubin' ;;\n"
        f"  -sass) cat '{tmp_path / 'sass.txt'}' ;;\n"
        "esac\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    lister = inspect_wheels.cuobjdump_lister(str(fake))
    assert inspect_wheels.RECURRENCE_BLOCKS == (64, 128)
    for blocks, expected in (((128, 64), None), ((128, 64, 32), "[32, 64, 128]"), ((64,), "[64]")):
        (tmp_path / "sass.txt").write_text(listing(*blocks))
        code = lister(tmp_path / "x.so")
        assert [k.split("ILi")[1].split("EE")[0] for k in code.kernels] == [str(bv) for bv in blocks]
        problems = inspect_wheels.check_extension_binary(make_elf([]), "cula_sm90/_C.so", lister)
        found = [p for p in problems if "recurrence kernels" in p]
        assert found == ([] if expected is None else [
            f"cula_sm90/_C.so: recurrence kernels for V blocks {expected}; expected exactly [64, 128] "
            "(RECURRENCE_BLOCKS)"]), blocks


def test_cuobjdump_resource_usage_finds_spilling_kernels(tmp_path: Path) -> None:
    """A kernel with local memory (spills) or a stack is named; the others are not, and the check reports it."""
    fake = tmp_path / "cuobjdump"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        "  --list-elf) echo 'ELF file    1: _C.cpython-311-x86_64-linux-gnu.1.sm_90a.cubin' ;;\n"
        "  -res-usage) printf 'Resource usage:\\n Function good:\\n  REG:255 STACK:0 SHARED:1024 LOCAL:0 X\\n"
        " Function spills:\\n  REG:128 STACK:8 SHARED:0 LOCAL:4 X\\n' ;;\n"
        "esac\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    lister = inspect_wheels.cuobjdump_lister(str(fake))
    assert lister(tmp_path / "x.so").local_memory == ("spills",)
    problems = inspect_wheels.check_extension_binary(make_elf([]), "cula_sm90/_C.so", lister)
    assert any("local memory" in p and "spills" in p and "good" not in p for p in problems)
