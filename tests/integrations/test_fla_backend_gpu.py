"""FLA's ``chunk_kda`` and KDA decode through cuLA on the GPU (marked ``gpu``; FLA with Triton needed), for each GPU
backend: the call reaches cuLA (never FLA's kernels), returns what ``cula.kda`` returns bit for bit, and is within
the frozen bound of the fp64 oracle (``tests/gpu_backends.py``: 1.25x FLA's error), beside FLA's own Triton path on
the same inputs (``FLA_CULA=0``), whose error and both times go to ``$CULA_ERROR_LOG`` when it is set.

On the H200: ``CULA_ERROR_LOG=/tmp/fla_doors.log pytest -m gpu tests/integrations/test_fla_backend_gpu.py``.
"""

from __future__ import annotations

import importlib
import os
import warnings

import pytest
import torch

if os.environ.get("CULA_REQUIRE_FLA") == "1":
    import fla  # noqa: F401
else:
    pytest.importorskip("fla", reason="FLA is not installed here")
pytest.importorskip("triton", reason="FLA's own path needs triton")

import cula  # noqa: E402, F401
from cula import dispatch  # noqa: E402
from cula.integrations import fla as cula_fla  # noqa: E402
from cula.kda import kda_decode, kda_prefill  # noqa: E402
from cula_runtime.kda_decode_args import validate_kda_decode  # noqa: E402
from tests.gpu_backends import BACKENDS, bound, use_backend  # noqa: E402
from tests.helpers import rel_l2  # noqa: E402
from tests.kda_cases import CASES, UNBOUNDED_CASES, make_inputs, oracle  # noqa: E402

pytestmark = pytest.mark.gpu

# FLA requires an fp32 initial state: the cases with one (or none), fixed and packed, every gate form
NAMES = ("B2-T200-H4", "B2-T129-H4-HV8-vk", "B3-T130-H2-noh0", "varlen-0-1-64-65-200", "varlen-6seqs-GVA2-vk",
         "kimi-B1-T1000-H4", "kimi-precomputed-fp32-varlen-serving", "extreme-varlen-GVA2-vk")
PICKED = [case for case in CASES + UNBOUNDED_CASES if case.name in NAMES]


def _fla_kwargs(kwargs: dict) -> dict:
    """cuLA's keyword arguments as FLA's callers pass them: int64 ``cu_seqlens``."""
    out = dict(kwargs)
    if "cu_seqlens" in out:
        out["cu_seqlens"] = out["cu_seqlens"].long()
    return out


def _gpu_ms(fn, reps: int = 20) -> float:
    """Median CUDA-event time of one call (synchronised), after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _log(line: str) -> None:
    if os.environ.get("CULA_ERROR_LOG"):
        with open(os.environ["CULA_ERROR_LOG"], "a") as log:
            log.write(line + "\n")


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> dict:
    """How many times the FLA backend called cuLA's Python API. No call plan is left from earlier tests (a call
    whose signature has one runs the plan itself, not the API: in a session of many GPU tests the spies would then
    see nothing)."""
    from cula import call_plans

    call_plans.clear_call_plans()
    calls = {"kda_prefill": 0, "kda_decode": 0}

    def spy_on(name: str):
        real = getattr(cula_fla, name)

        def spy(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return spy

    for name in calls:
        monkeypatch.setattr(cula_fla, name, spy_on(name))
    return calls


@pytest.mark.parametrize("case", PICKED, ids=[c.name for c in PICKED])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fla_chunk_kda_through_cula_against_fla_s_own_path(backend: str, case, served: dict,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from fla.ops.kda import chunk_kda

    use_backend(backend, monkeypatch)
    kwargs = make_inputs(case, "cuda")
    fla_kwargs = _fla_kwargs(kwargs)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.CulaFallbackWarning)
        o, ht = chunk_kda(**fla_kwargs)
        assert served["kda_prefill"] == 1, "FLA's chunk_kda did not reach cuLA"
        o_direct, ht_direct = kda_prefill(**kwargs)
        cula_ms = _gpu_ms(lambda: chunk_kda(**fla_kwargs))
        reached = served["kda_prefill"]
        monkeypatch.setenv("FLA_CULA", "0")
        o_fla, ht_fla = chunk_kda(**fla_kwargs)
        fla_ms = _gpu_ms(lambda: chunk_kda(**fla_kwargs))
        monkeypatch.delenv("FLA_CULA")
    assert served["kda_prefill"] == reached, "FLA_CULA=0 still reached cuLA"
    assert torch.equal(o, o_direct) and (ht is None) == (ht_direct is None)
    if ht is not None:
        assert torch.equal(ht, ht_direct)
    o_ref, ht_ref = oracle(kwargs)
    err = (rel_l2(o.cpu(), o_ref), rel_l2(ht.cpu(), ht_ref) if case.final_state else 0.0)
    err_fla = (rel_l2(o_fla.cpu(), o_ref), rel_l2(ht_fla.cpu(), ht_ref) if case.final_state else 0.0)
    _log(f"fla-door {backend} {case.name} o {err[0]:.4e} ht {err[1]:.4e} fla_own o {err_fla[0]:.4e} ht "
         f"{err_fla[1]:.4e} cula_via_fla_ms {cula_ms:.4f} fla_own_ms {fla_ms:.4f}")
    assert err[0] <= bound(case.name, 0), f"o error {err[0]:.3e} (FLA's own: {err_fla[0]:.3e})"
    if case.final_state:
        assert err[1] <= max(bound(case.name, 1), 1e-6), f"final state error {err[1]:.3e} (FLA's: {err_fla[1]:.3e})"


def _decode_call(seed: int = 0, B: int = 6, H: int = 4, HV: int = 8, P: int = 16) -> dict:
    """FLA's decode keyword arguments (one token per sequence, a pool, int32 slots) on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    K = V = 128

    def r(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).cuda()

    return dict(q=r(B, 1, H, K), k=r(B, 1, H, K), v=r(B, 1, HV, V), g=r(B, 1, HV, K, dtype=torch.float32),
                beta=r(B, 1, HV, dtype=torch.float32), A_log=torch.log(1 + 15 * torch.rand(HV, generator=gen)).cuda(),
                dt_bias=(0.5 * torch.randn(HV * K, generator=gen)).cuda(),
                initial_state=(0.5 * torch.randn(P, HV, K, V, generator=gen)).cuda(),
                ssm_state_indices=torch.randperm(P, generator=gen)[:B].to(torch.int32).cuda(),
                use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True)


def test_fla_decode_through_cula_against_fla_s_own_kernel(served: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """FLA's KDA decode on a pool: through cuLA's GPU decode kernel (skipped while kda_decode has none on this GPU)
    bit for bit as ``cula.kda.kda_decode``, and within 1e-2 (o) / 5e-3 (states) of FLA's own Triton kernel."""
    fused_recurrent = importlib.import_module("fla.ops.kda.fused_recurrent")
    monkeypatch.delenv("CULA_BACKEND", raising=False)
    call = _decode_call()
    cula_call = dict(state=call["initial_state"], state_indices=call["ssm_state_indices"], A_log=call["A_log"],
                     dt_bias=call["dt_bias"], use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                     use_beta_sigmoid_in_kernel=True)
    inputs = {name: call[name] for name in ("q", "k", "v", "g", "beta")}
    choice = dispatch.explain_decode(validate_kda_decode(**inputs, **cula_call))
    if choice.gpu_fallback or choice.runner is None:
        pytest.skip(f"kda_decode has no GPU kernel for this call here: {choice.summary}")
    start = call["initial_state"].clone()
    pools = {name: start.clone() for name in ("door", "direct", "fla")}
    o, final_state = fused_recurrent.fused_recurrent_kda_fwd(**{**call, "initial_state": pools["door"]})
    assert served["kda_decode"] == 1 and final_state is pools["door"]
    o_direct = kda_decode(**inputs, **{**cula_call, "state": pools["direct"]})
    assert torch.equal(o, o_direct) and torch.equal(pools["door"], pools["direct"])
    monkeypatch.setenv("FLA_CULA", "0")
    o_fla, _ = fused_recurrent.fused_recurrent_kda_fwd(**{**call, "initial_state": pools["fla"]})
    assert served["kda_decode"] == 1
    touched = (pools["fla"] != start).flatten(1).any(1)
    assert torch.equal(pools["door"][~touched], start[~touched])
    err_o, err_s = rel_l2(o.double(), o_fla.double()), rel_l2(pools["door"][touched], pools["fla"][touched])
    _log(f"fla-door decode o_vs_fla {err_o:.4e} states_vs_fla {err_s:.4e}")
    assert err_o <= 1e-2 and err_s <= 5e-3, (err_o, err_s)
