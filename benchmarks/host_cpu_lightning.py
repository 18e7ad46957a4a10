"""Host (Python) cost of one planned ``lightning_prefill`` call on the cutedsl backend, on a CPU: no GPU, nothing
compiled.

    python benchmarks/host_cpu_lightning.py [--calls 3000]

The call plan of ``plan_lightning_prefill`` (what a repeated ``cula.lightning.lightning_prefill`` call runs after
its signature lookup) on CPU tensors, with the kernels' compilation replaced by no-op callables and the device
reported as sm_90a (``host_cpu_kda.py``'s stubs): the segment table lookup, the allocations and the three launches'
Python, without the TVM-FFI calls and the CUDA allocations a GPU host adds. Reported per config: us per call (min
over 5 loops of ``--calls / 5`` calls, after warm-up) and allocations per call.
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


def make_args(B: int, T: int, H: int, lens: tuple | None):
    """bf16 q/k/v, FLA's decays for layer 0 of 2, fp32 final state out, on the CPU, validated."""
    from cula_runtime.lightning_args import validate_lightning_prefill

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(3))
    cu = None if lens is None else torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return validate_lightning_prefill(q, k, v, layer_idx=0, num_layers=2, output_final_state=True, cu_seqlens=cu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    opts = parser.parse_args()
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
