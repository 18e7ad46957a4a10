"""Host cost of one planned ``lightning_prefill`` call on the cutedsl backend: on a CPU with the kernels stubbed,
or (``--gpu``) the real call on a CUDA GPU.

    python benchmarks/host_path_lightning_prefill.py [--calls 3000]
    python benchmarks/host_path_lightning_prefill.py --gpu [--calls 200]

The call plan of ``plan_lightning_prefill`` (what a repeated ``cula.lightning.lightning_prefill`` call runs after
its signature lookup) on CPU tensors, with the kernels' compilation replaced by no-op callables and the device
reported as sm_90a (``host_cpu_kda.py``'s stubs): the segment table lookup, the allocations and the three launches'
Python, without the TVM-FFI calls and the CUDA allocations a GPU host adds. Reported per config: us per call (min
over 5 loops of ``--calls / 5`` calls, after warm-up) and allocations per call.

``--gpu``: ``cula.lightning.lightning_prefill`` itself (``CULA_BACKEND=cutedsl``: the signature lookup, then the
plan, its kernels launched) on the same configs on the current CUDA device, the host wall time of one call with the
GPU asleep (``host_overhead_kda.GpuSleep``: no call waits for the GPU): median and mean over ``--calls`` calls, and
whether the sleep outlasted them ("GPU busy").
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_cpu_kda import planned_call_cost, reuse_large_cpu_allocations  # noqa: E402

K = 128
CONFIGS = {  # name: (B, T, H, varlen lengths)
    "fixed B1 T512 H64": (1, 512, 64, None),
    "fixed B2 T1024 H16": (2, 1024, 16, None),
    "varlen T1024 4 seqs H64": (1, 1024, 64, (300, 124, 412, 188)),
}


def stub_kernels() -> None:
    """Replace compilation by no-op kernels and the GPU by an sm_90a one with 132 SMs."""
    from cula_runtime.cute import arch, compile_cache
    from cula_runtime.cute.lightning import chunk_output, chunk_states, prefill_backend

    arch.device_target = lambda device=None: "sm_90a"
    compile_cache.launch_target = lambda index: "sm_90a"
    compile_cache.require_cutedsl = lambda: types.SimpleNamespace(compile=lambda kernel, *a, options: lambda *b: None)
    for cls in (chunk_states.LightningSegmentStates, chunk_states.LightningSegmentScan,
                chunk_output.LightningChunkOutput):
        cls.compile_arguments = lambda self: ()
    prefill_backend.sm_count = lambda device: 132


def make_inputs(B: int, T: int, H: int, lens: tuple | None, device: str = "cpu") -> tuple:
    """bf16 q/k/v and the keywords: FLA's decays for layer 0 of 2, fp32 final state out, ``cu_seqlens``."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=gen).bfloat16().to(device) for _ in range(3))
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dict(layer_idx=0, num_layers=2, output_final_state=True,
                         cu_seqlens=None if cu is None else cu.to(device))


def make_args(B: int, T: int, H: int, lens: tuple | None):
    """:func:`make_inputs` on the CPU, validated."""
    from cula_runtime.lightning_args import validate_lightning_prefill

    q, k, v, kwargs = make_inputs(B, T, H, lens)
    return validate_lightning_prefill(q, k, v, **kwargs)


def gpu_main(calls: int) -> None:
    """The ``--gpu`` table."""
    import os

    from host_overhead_kda import GpuSleep, host_us

    from cula.lightning import lightning_prefill

    os.environ["CULA_BACKEND"] = "cutedsl"
    sleep = GpuSleep()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, host time of one planned cutedsl "
          "lightning_prefill call, GPU asleep\n")
    print("| config | host us (median) | host us (mean) | GPU busy |")
    print("|---|---|---|---|")
    for name, shape in CONFIGS.items():
        q, k, v, kwargs = make_inputs(*shape, device="cuda")

        def call(q=q, k=k, v=v, kwargs=kwargs) -> object:
            return lightning_prefill(q, k, v, **kwargs)

        for _ in range(10):
            call()
        torch.cuda.synchronize()
        median, mean, busy = host_us(call, calls, sleep, max(50.0, calls * 2.0))
        print(f"| {name} | {median:.1f} | {mean:.1f} | {'yes' if busy else 'no'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=None, help="calls per measurement (3000; --gpu: 200)")
    parser.add_argument("--gpu", action="store_true", help="the real call on the current CUDA GPU")
    opts = parser.parse_args()
    if opts.gpu:
        gpu_main(opts.calls or 200)
        return
    opts.calls = opts.calls or 3000
    torch.set_num_threads(1)
    reused = reuse_large_cpu_allocations()
    stub_kernels()
    from cula_runtime.cute.lightning.prefill_backend import plan_lightning_prefill

    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, CPU host path of a planned cutedsl "
          f"lightning_prefill call (kernels stubbed; large CPU allocations reused: {'yes' if reused else 'no'})\n")
    print("| config | planned us/call | allocations |")
    print("|---|---|---|")
    for name, shape in CONFIGS.items():
        args = make_args(*shape)
        tensors = (args.q, args.k, args.v, args.g_gamma, args.initial_state, args.cu_seqlens, None, None, None)
        us, allocations = planned_call_cost(plan_lightning_prefill(args), tensors, opts.calls)
        print(f"| {name} | {us:.1f} | {allocations} |")


if __name__ == "__main__":
    main()
