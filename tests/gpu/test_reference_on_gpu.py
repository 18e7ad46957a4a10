"""The torch reference backend on a CUDA GPU (the fallback of calls no GPU kernel serves), forced with
``CULA_BACKEND=reference``: these calls' shapes are ones the GPU kernels serve, whose bf16 stages the fp32 state's
bound here does not allow for.

Compares GPU results with the float64 oracle computed on the CPU, on fresh random inputs with outputs checked for
NaN, GVA, varlen with tails and an empty sequence, both beta dtypes, both state layouts; and checks that replays
are bit-identical.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from cula import dispatch
from cula.kda import kda_prefill
from cula_runtime.reference.kda_naive import kda_naive
from tests.helpers import rel_l2

pytestmark = pytest.mark.gpu

CONFIGS = {
    "B2-T200-H2-HV4-K128-bf16-betaf32": dict(B=2, T=200, H=2, HV=4, cu=None, beta=torch.float32, vk=False),
    "varlen-0-100-100-228-H4-HV4-bf16-betabf16": dict(B=1, T=228, H=4, HV=4, cu=[0, 100, 100, 228],
                                                      beta=torch.bfloat16, vk=True),
    "varlen-1-64-65-300-H2-HV8": dict(B=1, T=300, H=2, HV=8, cu=[0, 1, 64, 65, 300], beta=torch.float32, vk=False),
}


def _inputs(cfg: dict, device: str, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, T, H, HV, K, V = cfg["B"], cfg["T"], cfg["H"], cfg["HV"], 128, 128
    N = B if cfg["cu"] is None else len(cfg["cu"]) - 1
    bf16, f32 = torch.bfloat16, torch.float32

    def r(*shape, dtype=bf16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    state = (N, HV, V, K) if cfg["vk"] else (N, HV, K, V)
    kwargs = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=r(B, T, HV, K),
                  beta=r(B, T, HV, dtype=cfg["beta"]),
                  initial_state=r(*state, dtype=f32), output_final_state=True, use_qk_l2norm_in_kernel=True,
                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, A_log=r(HV, dtype=f32),
                  dt_bias=r(HV * K, dtype=f32), state_v_first=cfg["vk"])
    if cfg["cu"] is not None:
        kwargs["cu_seqlens"] = torch.tensor(cfg["cu"], dtype=torch.int32, device=device)
    return kwargs


def _to_cpu(kwargs: dict) -> dict:
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dispatch.ENV_FORCE, "reference")


@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_reference_on_gpu_matches_fp64_oracle(name: str) -> None:
    kwargs = _inputs(CONFIGS[name], "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.CulaFallbackWarning)
        o, ht = kda_prefill(**kwargs)
    o_ref, ht_ref = kda_naive(**_to_cpu(kwargs))
    assert o.is_cuda and o.dtype == torch.bfloat16 and ht.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(ht).all()
    # bf16 output: one rounding of o (~2e-3 rel.); the fp32 state has no rounding stage
    assert rel_l2(o.cpu(), o_ref) < 5e-3
    assert rel_l2(ht.cpu(), ht_ref) < 1e-4


def test_reference_on_gpu_is_deterministic() -> None:
    kwargs = _inputs(CONFIGS["varlen-1-64-65-300-H2-HV8"], "cuda", seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.CulaFallbackWarning)
        o0, ht0 = kda_prefill(**kwargs)
        for _ in range(20):
            o, ht = kda_prefill(**kwargs)
            assert torch.equal(o, o0) and torch.equal(ht, ht0)
