"""Host (Python) cost of one call of the cutedsl backend, on a CPU: no GPU, nothing compiled.

    python benchmarks/host_cpu_kda.py [--calls 3000] [--profile CONFIG]

``kda_prefill_cutedsl`` runs on CPU tensors with its kernels replaced by no-ops: ``cute.compile`` returns a callable
that does nothing and the device reports sm_90a, so ``compile_cache.launch``, ``compile_kernel`` and
``launch_target`` run as they do on a GPU (only the TVM-FFI call itself, about 7 us per launch on the H200 host,
is missing). Reported per config, after warm-up:

- us/call: the whole backend call (min over 5 loops of ``--calls / 5`` calls);
- launches: kernel launches per call; launch us: those launches alone (``compile_cache.launch`` with the recorded
  arguments), the rest being the backend's own work (plans, workspace, checks);
- allocations per call (torch dispatch: empty, empty_like, zeros, copies) and ``os.environ`` reads per call;
- planned us/call: the call plan of that signature (``plan_kda_prefill``: what a repeated ``cula.kda_prefill`` call
  runs after its signature lookup) on the same tensors, its launches bound once; its allocations.

CPU numbers are not GPU numbers: a CUDA ``torch.empty`` costs several times a CPU one (about 6 us on the H200 host,
``kda_host_overhead_h200.md``), while a view costs about the same on both. glibc maps every CPU allocation above
32 MiB afresh (about 12 us for the map and unmap), which the CUDA caching allocator does not, so on glibc the
script first raises the mmap and trim thresholds to 1 GiB (``mallopt``): large buffers are then reused, as on the
GPU. ``--profile CONFIG`` adds a cProfile of that config's planned call (cProfile roughly doubles small
functions). Measure on the GPU with ``host_overhead_kda.py``.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import ctypes.util
import io
import os
import pstats
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import AllocationCounter  # noqa: E402

K = 128
CONFIGS = {  # name: (B, T, H, HV, varlen lengths)
    "fixed B1 T64 H4": (1, 64, 4, 4, None),
    "fixed B1 T512 H64": (1, 512, 64, 64, None),
    "varlen T1024 4 seqs H64": (1, 1024, 64, 64, (300, 124, 412, 188)),
}


class Recorder:
    """The arguments of every ``compile_cache.launch`` call while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.launches: list = []


def stub_kernels() -> Recorder:
    """Replace compilation by no-op kernels and the GPU by an sm_90a one; return the recorder of launches."""
    from cula_runtime.cute import arch, compile_cache
    from cula_runtime.cute.kda import backend, intra, recurrence

    recorder = Recorder()
    arch.device_target = lambda device=None: "sm_90a"
    compile_cache.require_cutedsl = lambda: types.SimpleNamespace(compile=lambda kernel, *a, options: lambda *b: None)
    for cls in (intra.KdaIntra, recurrence.KdaRecurrence):
        cls.compile_arguments = lambda self: ()
    backend.sm_count = lambda device: 132  # H200
    real_launch = compile_cache.launch

    def launch(*args):
        if recorder.on:
            recorder.launches.append(args)
        return real_launch(*args)

    for module in (intra, recurrence):
        module.launch = launch
    return recorder


def make_args(B: int, T: int, H: int, HV: int, lens: tuple | None):
    """bench_kda_prefill.py's inputs and flags (bf16, gate / L2 norm / beta sigmoid in kernel, safe gate, fp32 h0,
    final state out), on the CPU, validated."""
    from cula_runtime.kda_args import validate_kda_prefill

    gen = torch.Generator().manual_seed(0)
    N = B if lens is None else len(lens)

    def randn(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cu = None
    if lens is not None:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return validate_kda_prefill(
        q=randn(B, T, H, K), k=randn(B, T, H, K), v=randn(B, T, HV, K), g=randn(B, T, HV, K),
        beta=randn(B, T, HV, dtype=torch.float32), initial_state=randn(N, HV, K, K, dtype=torch.float32),
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=randn(HV, dtype=torch.float32),
        dt_bias=randn(HV * K, dtype=torch.float32), cu_seqlens=cu,
    )


def per_call_us(fn, calls: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(calls // 5):
            fn()
        best = min(best, (time.perf_counter_ns() - start) / (calls // 5) / 1e3)
    return best


def planned_call_cost(plan, tensors: tuple, calls: int) -> tuple[float, int]:
    """``plan(*tensors)``'s us per call (:func:`per_call_us`, after 20 warm-up calls) and allocations per call."""

    def planned() -> None:
        plan(*tensors)

    for _ in range(20):
        planned()
    with AllocationCounter() as allocations:
        planned()
    return per_call_us(planned, calls), allocations.count


def environ_reads(fn) -> int:
    """How many ``os.environ.get`` calls one ``fn()`` makes."""
    reads = [0]
    environ_type = type(os.environ)
    own = vars(environ_type).get("get")
    real_get = environ_type.get

    def get(self, key, default=None):
        reads[0] += 1
        return real_get(self, key, default)

    environ_type.get = get
    try:
        fn()
    finally:
        if own is None:
            del environ_type.get
        else:
            environ_type.get = own
    return reads[0]


def reuse_large_cpu_allocations() -> bool:
    """glibc only: serve allocations up to 1 GiB from the heap and keep freed memory (as a caching allocator
    would), instead of mapping and unmapping each one. Returns whether it applied."""
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--profile", default="", help="a config name to cProfile")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    reused = reuse_large_cpu_allocations()
    recorder = stub_kernels()
    from cula_runtime.cute.compile_cache import launch
    from cula_runtime.cute.kda.backend import kda_prefill_cutedsl, plan_kda_prefill

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, CPU host path of kda_prefill_cutedsl "
          f"(kernels stubbed; large CPU allocations reused: {'yes' if reused else 'no'})\n")
    print("| config | us/call | launches | launch us | rest us | allocations | environ reads | planned us/call "
          "| planned allocations |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape in CONFIGS.items():
        args = make_args(*shape)

        def call(args=args) -> None:
            kda_prefill_cutedsl(args)

        for _ in range(20):
            call()
        recorder.on, recorder.launches = True, []
        call()
        recorder.on, launches = False, recorder.launches

        def launch_only(launches=launches) -> None:
            for launch_args in launches:
                launch(*launch_args)

        with AllocationCounter() as allocations:
            call()
        plan = plan_kda_prefill(args)
        tensors = (args.q, args.k, args.v, args.g, args.beta, args.initial_state, args.A_log, args.dt_bias,
                   args.cu_seqlens, args.cu_seqlens_host)

        total, launch_us = per_call_us(call, opts.calls), per_call_us(launch_only, opts.calls)
        planned_us, planned_allocations = planned_call_cost(plan, tensors, opts.calls)
        print(f"| {name} | {total:.1f} | {len(launches)} | {launch_us:.1f} | {total - launch_us:.1f} "
              f"| {allocations.count} | {environ_reads(call)} | {planned_us:.1f} | {planned_allocations} |")
        if opts.profile and opts.profile == name:
            profile = cProfile.Profile()
            profile.runcall(lambda plan=plan, tensors=tensors: [plan(*tensors) for _ in range(1000)])
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(25)
            print(f"\ncProfile, {name}, 1000 planned calls:\n```\n{out.getvalue().strip()}\n```\n")


if __name__ == "__main__":
    main()
