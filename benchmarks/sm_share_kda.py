"""How each cula-sm90 kernel's time scales with the SMs it gets: a design measurement for running the intra kernel
and the recurrence side by side on disjoint SMs (docs/STATUS.md).

    python benchmarks/sm_share_kda.py [--configs "varlen T4096 20xuniform,..."] [--free 132,110,88,66,44,22]
                                      [--reps 10] [--out results.md]

For each config and each count of free SMs, ``tools/sm_hog.cu`` (built here with nvcc) first occupies the other SMs
with CTAs that hold 200 KiB of shared memory each and sleep (no instructions to speak of, no bytes moved); once every
hog CTA is resident, one ``run_kernels`` call runs on another stream, on the free SMs only. torch.profiler gives each
kernel's mean time over ``--reps`` calls. A call that outlasts its hog is reported (its times would be wrong).

If the intra kernel (latency bound) scales with 1/SMs and the recurrence (bandwidth bound on many short sequences)
less than that, the two kernels run side by side on a split of the SMs, each chunk's recurrence step after its intra
item, take max(intra(n), recurrence(132 - n)) instead of their sum: the table's last section estimates that for the
measured splits, with the intra kernel's own bandwidth and the dependency between the kernels left out.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_kda_prefill import make_inputs, named_configs  # noqa: E402
from profile_kda import STAGES, stage_means  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = "varlen T4096 20xuniform,varlen T8192 20xuniform,varlen T16384 20xuniform,fixed B1 T16384"


class Hog:
    """``tools/sm_hog.cu`` built with nvcc into a temporary directory and loaded with ctypes."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory()
        lib = Path(self._dir.name) / "libsm_hog.so"
        subprocess.run(["nvcc", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib),
                        str(ROOT / "tools" / "sm_hog.cu")], check=True)
        self._lib = ctypes.CDLL(str(lib))
        self._lib.hog_launch.argtypes = (ctypes.c_int, ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_void_p)
        self._flags = torch.zeros(512, dtype=torch.int32, pin_memory=True)

    def occupy(self, ctas: int, ms: float, stream: torch.cuda.Stream) -> None:
        """``ctas`` SMs held for ``ms`` milliseconds from now (returns once every hog CTA runs)."""
        if ctas == 0:
            return
        self._flags.zero_()
        err = self._lib.hog_launch(ctas, int(ms * 1e6), self._flags.data_ptr(), stream.cuda_stream)
        if err:
            raise RuntimeError(f"hog_launch: CUDA error {err}")
        deadline = time.perf_counter() + 1.0
        while int(self._flags[:ctas].sum()) < ctas:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"only {int(self._flags[:ctas].sum())} of {ctas} hog CTAs became resident")


def kernel_times(run, hog: Hog, hogged: int, hog_ms: float, reps: int) -> tuple[dict[str, float], int]:
    """Mean us per call of the intra and recurrence kernels with ``hogged`` SMs held, and how many calls outlasted
    their hog."""
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    late = 0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            start, hog_end, call_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
            start.record(side)
            hog.occupy(hogged, hog_ms, side)
            hog_end.record(side)
            with torch.cuda.stream(main):
                run()
                call_end.record(main)
            torch.cuda.synchronize()
            if hogged and start.elapsed_time(call_end) > start.elapsed_time(hog_end):
                late += 1
    return stage_means(prof, STAGES["sm90"], reps), late  # (the hog's own time lands under "other")


def main() -> None:
    from cula_runtime.kda_args import validate_kda_prefill
    from cula_sm90.kda import run_kernels

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS)
    parser.add_argument("--free", default="132,110,88,66,44,22", help="comma-separated counts of SMs left free")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="")
    opts = parser.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    frees = [min(int(x), sms) for x in opts.free.split(",")]
    hog = Hog()
    lines = [f"- GPU: {torch.cuda.get_device_name(0)} ({sms} SMs); torch {torch.__version__}; "
             f"{time.strftime('%Y-%m-%dT%H:%M%z')}",
             f"- command: `python benchmarks/sm_share_kda.py --configs \"{opts.configs}\" --free {opts.free} "
             f"--reps {opts.reps}`", "",
             "| config | free SMs | intra us | recurrence us | intra x free/SMs | recurrence x free/SMs | late calls |",
             "|---|---|---|---|---|---|---|"]
    splits = []
    for cfg in named_configs(opts.configs):
        args = validate_kda_prefill(**make_inputs(cfg))
        run = functools.partial(run_kernels, args)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        # the call's time on all SMs sets each hog's time: 3x the call's time on the SMs left, plus 1 ms
        t, _ = kernel_times(run, hog, 0, 0.0, 3)
        base_ms = (t["intra"] + t["recurrence"]) / 1e3
        measured = {}
        for free in frees:
            hog_ms = 1.0 + 3.0 * base_ms * sms / free
            t, late = kernel_times(run, hog, sms - free, hog_ms, opts.reps)
            measured[free] = (t["intra"], t["recurrence"])
            lines.append(f"| {cfg.name} | {free} | {t['intra']:.1f} | {t['recurrence']:.1f} | "
                         f"{t['intra'] * free / sms:.1f} | {t['recurrence'] * free / sms:.1f} | {late} |")
            print(lines[-1], flush=True)
        full = measured.get(sms)
        if full:
            for n_intra in frees:
                n_rec = sms - n_intra
                if n_rec in measured and n_intra != sms:
                    side_by_side = max(measured[n_intra][0], measured[n_rec][1])
                    splits.append(f"| {cfg.name} | {n_intra} / {n_rec} | {sum(full):.1f} | {side_by_side:.1f} | "
                                  f"{side_by_side / sum(full):.2f} |")
    lines += ["", "Side by side on a split of the SMs (estimate: max of the two kernels' times at their shares, "
              "against the sum of both on all SMs):", "",
              "| config | SMs intra / recurrence | sum on all SMs us | side by side us | ratio |",
              "|---|---|---|---|---|",
              *splits]
    text = "\n".join(lines) + "\n"
    print(text)
    if opts.out:
        Path(opts.out).write_text(text)


if __name__ == "__main__":
    main()
