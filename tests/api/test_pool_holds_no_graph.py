"""A state pool holds states, never autograd history: a pool call whose inputs require grad (a model in train mode,
``nn.Parameter`` decays) leaves the pool a plain tensor, so the next call on it runs (CPU reference backend)."""

from __future__ import annotations

import pytest
import torch

from cula.kda import kda_decode, kda_prefill
from cula.lightning import lightning_decode, lightning_prefill

B, T, H, K, V, P = 2, 3, 2, 8, 4, 5


def _inputs(lightning: bool) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen, requires_grad=True) for _ in range(2))
    kwargs = dict(q=q, k=k, v=torch.randn(B, T, H, V, generator=gen, requires_grad=True),
                  state=torch.randn(P, H, K, V, generator=gen),
                  state_indices=torch.tensor([3, 1], dtype=torch.int32))
    if lightning:
        kwargs["g_gamma"] = torch.nn.Parameter(-torch.rand(H, generator=gen))
    else:
        kwargs.update(g=(-torch.rand(B, T, H, K, generator=gen)).requires_grad_(),
                      beta=torch.rand(B, T, H, generator=gen))
    return kwargs


CALLS = {
    "kda_prefill": (False, kda_prefill),
    "kda_decode": (False, kda_decode),
    "lightning_prefill": (True, lightning_prefill),
    "lightning_decode": (True, lightning_decode),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_pool_call_with_grad_inputs_leaves_a_plain_pool(name: str) -> None:
    lightning, call = CALLS[name]
    kwargs = _inputs(lightning)
    pool = kwargs["state"]
    result = call(**kwargs)
    o = result[0] if isinstance(result, tuple) else result
    assert o.requires_grad  # (the reference's outputs keep their graph)
    assert not pool.requires_grad and pool.grad_fn is None
    before = pool.clone()
    call(**kwargs)  # the next step on the same pool runs
    assert not pool.requires_grad and not torch.equal(pool[[3, 1]], before[[3, 1]])
