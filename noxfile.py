"""cuLA's developer and CI sessions: ``nox -s lint tests cute_compile_oldest wheel_inspect`` is what CI (.ci/run) runs.

Sessions that install torch take the CPU build through constraints/cpu.txt, never a CUDA build.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests", "cute_compile_oldest", "wheel_inspect"]

ROOT = Path(__file__).resolve().parent
PYTHON = "3.11"
CPU_CONSTRAINTS = ("-c", "constraints/cpu.txt")
PURE_PACKAGES = ("packages/cula-runtime", "packages/cula")
SM90_PACKAGE = "packages/cula-sm90"
DIST = "dist"
RUFF = "ruff==0.17.6"
CUOBJDUMP = "nvidia-cuda-cuobjdump>=13.2,<14"
# The compile tests' disassembler (cula_runtime.cute.machine_code); CuTeDSL 4.6 brought it, 4.8 does not.
NVDISASM = "nvidia-cuda-nvdisasm>=13,<14"
# The oldest CuTeDSL cula-runtime admits; `tests` compiles against the newest (what a plain install resolves to).
OLDEST_CUTEDSL = "nvidia-cutlass-dsl==4.6.2"
# FLA for the `fla` session: the release whose backend registry cula.integrations.fla plugs into, and what its KDA ops
# import (triton at module level, einops; packaging for its version checks).
FLA = ("fla-core==0.6.0", "einops", "triton", "packaging")


def install_torch_cpu(session: nox.Session, *others: str) -> None:
    """torch, CPU build only (constraints/cpu.txt), with any other packages named."""
    session.install("torch", *others, *CPU_CONSTRAINTS)


def built_pure_wheels(session: nox.Session) -> list[str]:
    """Build the cula-runtime and cula wheels into the session's tmp folder; return their paths."""
    wheels = Path(session.create_tmp()) / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    session.run("python", "tools/build_wheels.py", "--dest", str(wheels), *PURE_PACKAGES)
    return [str(path) for path in sorted(wheels.glob("*.whl"))]


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff check over the whole repository (configuration in the root pyproject.toml)."""
    session.install(RUFF)
    session.run("ruff", "check", ".")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """pytest on the CPU: GPU tests (marked gpu) skip without a CUDA GPU. Extra arguments go to pytest."""
    install_torch_cpu(session, "pytest", "pytest-xdist", "numpy", NVDISASM)
    # One pip call, so the local cula-runtime satisfies cula's cula-runtime==<version> pin. cula-runtime's own
    # dependencies bring CuTeDSL (the newest its range admits), so the compile tests build every shipped CuTeDSL
    # kernel for sm_90a, sm_100a and sm_103a here.
    session.install("-e", PURE_PACKAGES[0], "-e", PURE_PACKAGES[1], *CPU_CONSTRAINTS)
    # The cula-sm90 shim from source (pure Python; no sm90 is installed here): its marshalling and call-plan tests
    # drive it through a stand-in extension. Only here: on a GPU machine the built package (with its extension) must
    # come first on the path, which pytest's own `pythonpath` setting would not allow (it prepends).
    shim = str(Path(SM90_PACKAGE, "src").resolve())
    # pytest-xdist workers, one per core up to 4 (CULA_TEST_WORKERS overrides; "-n 0" in the arguments runs serially):
    # most of the time is CuTeDSL compiles, which do not always use both of CI's cores.
    workers = os.environ.get("CULA_TEST_WORKERS") or str(min(os.cpu_count() or 1, 4))
    session.run("pytest", "-q", "-n", workers, *session.posargs, env={"PYTHONPATH": shim})


@nox.session(python=PYTHON)
def fla(session: nox.Session) -> None:
    """cuLA as a backend of FLA's registry, on the CPU: tests/integrations with fla-core 0.6.0 installed beside cula
    (never in `tests`, which checks that cula needs no FLA). CULA_REQUIRE_FLA=1 makes the FLA tests import FLA
    instead of skipping without it, so this session fails rather than skipping them all. cula and cula-runtime come
    without their dependencies beyond torch: CuTeDSL, which a plain install brings, serves no CPU call (a minute of
    installation saved; `wheel_inspect` checks the plain install)."""
    install_torch_cpu(session, "pytest", *FLA)
    session.install("--no-deps", "-e", PURE_PACKAGES[0], "-e", PURE_PACKAGES[1])
    session.run("python", "-c", "import importlib.metadata as m; print('fla-core', m.version('fla-core'), 'triton', "
                "m.version('triton'))")
    session.run("pytest", "-q", "-p", "no:cacheprovider", "tests/integrations", *session.posargs,
                env={"CULA_REQUIRE_FLA": "1"})


@nox.session(python=PYTHON)
def cute_compile(session: nox.Session) -> None:
    """Only the CuTeDSL compile tests: every shipped kernel for sm_90a, sm_100a and sm_103a, SASS checked (CPU)."""
    install_torch_cpu(session, "pytest", "numpy", NVDISASM)
    session.install("-e", PURE_PACKAGES[0], "-e", PURE_PACKAGES[1], *CPU_CONSTRAINTS)
    session.run("pytest", "-q", "-m", "compile", *session.posargs)


@nox.session(python=PYTHON)
def cute_compile_oldest(session: nox.Session) -> None:
    """The compile tests marked ``dsl_floor`` (one configuration per CuTeDSL kernel family, for sm_90a, sm_100a and
    sm_103a, with the same machine-code checks) against the oldest CuTeDSL cula-runtime admits; CI runs it."""
    install_torch_cpu(session, "pytest", "numpy", NVDISASM)
    session.install("-e", PURE_PACKAGES[0], "-e", PURE_PACKAGES[1], OLDEST_CUTEDSL, *CPU_CONSTRAINTS)
    session.run("python", "-c", "import importlib.metadata as m; print('CuTeDSL', m.version('nvidia-cutlass-dsl'))")
    session.run("pytest", "-q", "-m", "compile and dsl_floor", *session.posargs)


def build_wheels(session: nox.Session) -> bool:
    """Build into a clean dist/: the pure wheels always, cula-sm90 when nvcc is on PATH. True if sm90 was built."""
    packages = list(PURE_PACKAGES)
    nvcc = shutil.which("nvcc")
    if nvcc:
        session.log(f"nvcc found at {nvcc}: building the cula-sm90 wheel too")
        packages.append(SM90_PACKAGE)
    else:
        session.warn("nvcc is not on PATH: skipping the cula-sm90 wheel (only the pure wheels are built)")
    session.run("python", "tools/build_wheels.py", "--clean", "--dest", DIST, *packages)
    return bool(nvcc)


@nox.session(python=PYTHON)
def wheel(session: nox.Session) -> None:
    """Build cula-runtime and cula (and cula-sm90 with nvcc) wheels into dist/."""
    build_wheels(session)


@nox.session(python=PYTHON)
def wheel_inspect(session: nox.Session) -> None:
    """Build the wheels (as ``nox -s wheel``), then check them with tools/inspect_wheels.py."""
    with_sm90 = build_wheels(session)
    session.install("packaging", *([CUOBJDUMP] if with_sm90 else []))
    session.run("python", "tools/inspect_wheels.py", DIST, *(["--require-sm90"] if with_sm90 else []))
    # `pip install cula` as a user runs it (the pure wheels with their dependencies, no extra): CuTeDSL must come.
    pure = [str(path) for name in ("cula_runtime", "cula") for path in sorted(Path(DIST).glob(f"{name}-*.whl"))]
    install_torch_cpu(session, *pure)
    session.run("python", "tools/check_install.py")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """Install torch (CPU) and the cula-runtime and cula wheels, then run ``python -m cula demo``."""
    install_torch_cpu(session, "numpy")  # numpy only to spare torch's "Failed to initialize NumPy" warning
    session.install(*built_pure_wheels(session), *CPU_CONSTRAINTS)
    session.run("python", "-m", "cula", "demo")


_HAS_CUDA_GPU = """
try:
    import torch
except ImportError:
    print(False)
else:
    print(torch.cuda.is_available())
"""


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Run every benchmarks/bench_*.py on a CUDA GPU; without one, say so and pass.

    Runs in the interpreter that runs nox (on the GPU machine: the one holding its CUDA build of torch),
    with cuLA's sources on PYTHONPATH: nothing is installed, so no torch is ever downloaded.
    """
    has_gpu = session.run(sys.executable, "-c", _HAS_CUDA_GPU, silent=True).strip().splitlines()[-1] == "True"
    if not has_gpu:
        session.log("bench: no CUDA GPU here; benchmarks need the H200 (see benchmarks/README)")
        return
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    if not scripts:
        session.error("bench: no benchmarks/bench_*.py found")
    # cula-sm90, when wanted, is the wheel installed in that interpreter (its extension is not in the sources).
    env = {"PYTHONPATH": os.pathsep.join(str(ROOT / package / "src") for package in PURE_PACKAGES)}
    for script in scripts:
        session.run(sys.executable, str(script.relative_to(ROOT)), *session.posargs, env=env)
