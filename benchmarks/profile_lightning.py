"""Per-kernel GPU time of the cutedsl Lightning prefill (segment states, scan, output) at a few shapes and segment
lengths, from torch.profiler's CUDA activity (every kernel launch, TVM-FFI's included).

    python benchmarks/profile_lightning.py [--shapes B,T,H ...] [--seg-lens 0,512,1024,...] [--reps 5] [--segments]

``--seg-lens 0`` is the backend's own choice; any other value is passed to the cutedsl backend as its fixed
``seg_len`` (the calls run the backend on validated arguments, as ``cula.lightning`` does after dispatch; the form
by the per-call rule, or the three launches with ``--segments``, as long segments would often take the direct
form). Prints
one line per (shape, segment length): each kernel's median time per call in us, their sum, and the bytes floor of
the call (q, k, v read and o written once, bf16, at 4.3 TB/s).
"""

from __future__ import annotations

import argparse
import statistics

PEAK_BYTES_PER_S = 4.3e12  # the decode and prefill benchmarks' HBM figure for the H200


def _short(kernel_name: str) -> str:
    """A kernel's name without the compiler's prefix and mangled tail: what tells the kernels apart."""
    for family in ("LightningSegmentStates", "LightningSegmentScan", "LightningChunkOutput"):
        if family in kernel_name:
            return family
    return kernel_name[:80]


def _parse_shape(text: str) -> tuple[int, int, int]:
    B, T, H = (int(x) for x in text.split(","))
    return B, T, H


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", type=_parse_shape,
                        default=[(1, 32768, 64), (1, 32768, 16), (1, 4096, 64), (2, 4096, 16)])
    parser.add_argument("--seg-lens", default="0,512,1024,2048")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--segments", action="store_true", help="force the three launches (never the direct form)")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from cula_runtime.cute.lightning.prefill_backend import lightning_prefill_cutedsl_backend
    from cula_runtime.lightning_args import validate_lightning_prefill

    D = 128
    direct = False if args.segments else None
    for B, T, H in args.shapes:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
        floor_us = 4 * q.numel() * 2 / PEAK_BYTES_PER_S * 1e6
        call = validate_lightning_prefill(q, k, v, layer_idx=0, num_layers=2)
        for seg_len in (int(x) for x in args.seg_lens.split(",")):
            for _ in range(3):
                lightning_prefill_cutedsl_backend(call, seg_len=seg_len, direct=direct)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.reps):
                    lightning_prefill_cutedsl_backend(call, seg_len=seg_len, direct=direct)
                torch.cuda.synchronize()
            times: dict[str, list[float]] = {}
            for event in prof.events():
                if event.device_type.name == "CUDA":
                    times.setdefault(event.name, []).append(event.device_time)
            parts = {name: statistics.median(ts) for name, ts in times.items()}
            total = sum(statistics.median(ts) * len(ts) / args.reps for ts in times.values())
            line = "; ".join(f"{_short(name)} {us:.1f} x{len(times[name]) // args.reps}" for name, us in parts.items())
            print(f"B{B} T{T} H{H} seg_len={seg_len or 'auto'}: total {total:.1f} us (floor {floor_us:.1f}, "
                  f"{total / floor_us:.2f}x): {line}", flush=True)


if __name__ == "__main__":
    main()
