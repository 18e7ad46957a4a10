"""The custom op ``torch.ops.cula.kda_prefill`` reaches the call plan the plain call left (issue 27 item 4: the op's
host time over the plain call's is the dispatcher's, not a second validation). Driven on CPU tensors with the sm90
shim on a fake extension (``fake_sm90``)."""

from __future__ import annotations

import torch

import cula.kda
import cula.ops  # noqa: F401  (defines torch.ops.cula.*)
from cula import call_plans, dispatch
from cula_runtime.kda_args import validate_kda_prefill
from tests.api.op_helpers import counted


def _kwargs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    B, T, H, K = 1, 64, 2, 128
    q, k, v, g = (torch.randn(B, T, H, K, generator=gen).bfloat16() for _ in range(4))
    return dict(q=q, k=k, v=v, g=g, beta=torch.randn(B, T, H, generator=gen).bfloat16(),
                initial_state=torch.zeros(B, H, K, K),
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0, A_log=torch.zeros(H),
                dt_bias=torch.zeros(H * K))


def test_the_custom_op_runs_the_plain_calls_plan(fake_sm90, monkeypatch) -> None:
    kda, fake = fake_sm90
    fake.o_bytes = fake.state_bytes = 0  # (the fake recurrence writes nothing)
    validations = []
    monkeypatch.setattr(cula.kda, "validate_kda_prefill", counted(validate_kda_prefill, validations))
    monkeypatch.setattr(cula.kda, "select_backend", lambda args: kda.kda_prefill)
    monkeypatch.setattr(dispatch, "_planners", {kda.kda_prefill: kda.plan_kda_prefill})
    monkeypatch.delenv("CULA_CALL_PLANS", raising=False)
    call_plans.clear_call_plans()
    try:
        cula.kda.kda_prefill(**_kwargs(0))
        assert len(validations) == 1
        cula.kda.kda_prefill(**_kwargs(1))
        assert len(validations) == 1, "the plain call's second call: planned"
        torch.ops.cula.kda_prefill(**_kwargs(2))
        assert len(validations) == 1, "the custom op's call: the same plan"
    finally:
        call_plans.clear_call_plans()
