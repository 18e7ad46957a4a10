"""Why the bench's varlen sm90 times exceed host_overhead_kda.py's eager times (a one-off probe for the H200).

Times sm90 on one varlen config: alone, through the bench's contender wrapper, after one FLA call, after FLA's
whole timing loop, and after the CuTeDSL backend; prints a line per case."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import torch  # noqa: E402
from bench_kda_prefill import contenders, make_inputs, named_configs, time_ms  # noqa: E402

from cula.kda import kda_prefill  # noqa: E402


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "varlen T4096 10xuniform"
    cfg = named_configs(name)[0]
    kw = make_inputs(cfg)
    runs = contenders()
    os.environ["CULA_BACKEND"] = "sm90"

    def direct() -> object:
        return kda_prefill(**kw)

    wrapped = runs["cula-sm90"]
    print(name)
    print("direct", round(time_ms(direct, 50), 4))
    print("wrapped", round(time_ms(lambda: wrapped(kw), 50), 4))
    runs["fla"](kw)
    torch.cuda.synchronize()
    print("wrapped after one FLA call", round(time_ms(lambda: wrapped(kw), 50), 4))
    print("fla", round(time_ms(lambda: runs["fla"](kw), 30), 4))
    print("wrapped after FLA loop", round(time_ms(lambda: wrapped(kw), 50), 4))
    print("direct after FLA loop", round(time_ms(direct, 50), 4))
    print("cutedsl", round(time_ms(lambda: runs["cula-cutedsl"](kw), 30), 4))
    print("wrapped after cutedsl", round(time_ms(lambda: wrapped(kw), 50), 4))
    print("direct again", round(time_ms(direct, 50), 4))


if __name__ == "__main__":
    main()
