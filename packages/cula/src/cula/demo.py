"""``python -m cula demo``: one KDA prefill on the best backend present, checked against the fp64 oracle.

B=1, packed varlen T=2048 (sequences of 300, 800 and 948 tokens: partial tail chunks), H=4 q/k heads, HV=8 value
heads (GVA 2:1), K=V=128, bf16 inputs, gate / L2 norm / beta sigmoid in kernel (safe gate, lower_bound=-5).
"""

from __future__ import annotations

import time

import torch

from cula_runtime.kda_args import validate_kda_prefill
from cula_runtime.reference.kda_naive import kda_naive

from . import dispatch
from .kda import kda_prefill

__all__ = ["run_demo"]


def _rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))


def run_demo(device: str | None = None, repeats: int = 3) -> dict:
    """Run the demo; returns backend, time and errors (also printed)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator().manual_seed(2026)
    lens = [300, 800, 948]
    T, H, HV, K, V = sum(lens), 4, 8, 128, 128
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)

    def rand(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    f32 = torch.float32
    kwargs = dict(
        q=rand(1, T, H, K), k=rand(1, T, H, K), v=rand(1, T, HV, V), g=rand(1, T, HV, K), beta=rand(1, T, HV),
        initial_state=0.1 * rand(len(lens), HV, K, V, dtype=f32), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, safe_gate=True,
        lower_bound=-5.0, A_log=rand(HV, dtype=f32), dt_bias=rand(HV * K, dtype=f32), cu_seqlens=cu,
    )
    choice = dispatch.explain(validate_kda_prefill(**kwargs))
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        start = time.perf_counter()
        o, ht = kda_prefill(**kwargs)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - start)

    # fp64 oracle on a prefix: the first two sequences (tokens [0, 1100)).
    n_prefix = 2
    t_prefix = sum(lens[:n_prefix])
    prefix = dict(kwargs)
    for name in ("q", "k", "v", "g", "beta"):
        prefix[name] = kwargs[name][:, :t_prefix]
    prefix["initial_state"] = kwargs["initial_state"][:n_prefix]
    prefix["cu_seqlens"] = cu[: n_prefix + 1]
    prefix.pop("safe_gate")
    o_ref, ht_ref = kda_naive(**prefix)
    result = {
        "backend": choice.summary,
        "device": str(dev),
        "shapes": f"q/k [1, {T}, {H}, {K}], v [1, {T}, {HV}, {V}], cu_seqlens {cu.tolist()}, bf16",
        "median_ms": sorted(times)[len(times) // 2] * 1e3,
        "rel_l2_o": _rel_l2(o[:, :t_prefix], o_ref),
        "rel_l2_state": _rel_l2(ht[:n_prefix], ht_ref),
    }
    print("cuLA demo: kda_prefill")
    print(f"  backend: {result['backend']}")
    print(f"  device:  {result['device']}")
    print(f"  shapes:  {result['shapes']}")
    print(f"  time:    {result['median_ms']:.2f} ms (median of {repeats})")
    print(f"  rel. L2 error vs fp64 kda_naive on the first {t_prefix} tokens ({n_prefix} sequences): "
          f"o {result['rel_l2_o']:.2e}, final state {result['rel_l2_state']:.2e}")
    return result
