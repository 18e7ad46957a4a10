"""The Lightning pool tests' inputs and fp64 oracle: each sequence run alone by ``lightning_naive`` (the float64
token recurrence) from its slot, the pool's expected contents built slot by slot (KDA_SPEC §5, §10). Shared by the
CPU tests (tests/reference/test_lightning_pool.py) and the GPU tests (tests/gpu/test_lightning_gpu.py)."""

from __future__ import annotations

import torch

from cula_runtime.reference.lightning import lightning_naive


def make_inputs(B: int, T: int, H: int, K: int, V: int, *, seed: int, dtype: torch.dtype = torch.float32,
                device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k ``[B, T, H, K]`` and v ``[B, T, H, V]``, moderate magnitudes (q, k scaled by 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    q = 0.5 * torch.randn(B, T, H, K, generator=gen)
    k = 0.5 * torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


def make_pool(P: int, H: int, K: int, V: int, *, v_first: bool, dtype: torch.dtype = torch.float32, seed: int = 7,
              device: str = "cpu") -> torch.Tensor:
    """A pool ``[P, H, K, V]`` (``[P, H, V, K]``) of random states (entries ~0.3)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (P, H, V, K) if v_first else (P, H, K, V)
    return (0.3 * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def bounds_of(lens: list[int] | None, B: int, T: int) -> list[int]:
    """Each sequence's first token in the flattened ``[B * T]`` token axis, and the end: ``[N + 1]``."""
    if lens is None:
        return [b * T for b in range(B + 1)]
    out = [0]
    for length in lens:
        out.append(out[-1] + length)
    return out


def _sequence(x: torch.Tensor, begin: int, end: int) -> torch.Tensor:
    """Tokens ``[begin, end)`` of the flattened ``[B * T, H, D]`` tensor as a batch of one ``[1, L, H, D]``."""
    return x.reshape(-1, *x.shape[2:])[begin:end].unsqueeze(0)


def pool_oracle(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g_gamma: torch.Tensor, scale: float | None,
                pool: torch.Tensor, indices: list[int], lens: list[int] | None, *, v_first: bool, decode: bool,
                has_initial_state: list[bool] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 outputs ``[B, T, H, V]`` and the pool's expected contents after a pool call.

    Sequence ``n`` (``lens``: packed lengths, or None: ``B`` rows of ``T``) reads slot ``indices[n]`` when it is in
    ``[0, P)`` (zeros where ``has_initial_state[n]`` is False), runs alone through ``lightning_naive`` and its final
    state (rounded to the pool's dtype) replaces the slot; a decode call's sequence of no tokens writes nothing. A
    slot outside ``[0, P)`` is padding: nothing read or written, its outputs zeros (KDA_SPEC §10). Every other slot
    keeps its bits."""
    B, T, H = q.shape[0], q.shape[1], q.shape[2]
    V = v.shape[3]
    P = pool.shape[0]
    cpu = torch.device("cpu")
    q, k, v, g_gamma = (x.to(cpu) for x in (q, k, v, g_gamma))
    expected = pool.to(cpu).clone()
    o = torch.zeros(B * T, H, V, dtype=torch.float64)
    bounds = bounds_of(lens, B, T)
    for n, slot in enumerate(indices):
        begin, end = bounds[n], bounds[n + 1]
        if not 0 <= slot < P:
            continue  # (padding)
        h0 = None
        if has_initial_state is None or has_initial_state[n]:
            h0 = expected[slot].double().unsqueeze(0)
        o_n, ht = lightning_naive(_sequence(q, begin, end), _sequence(k, begin, end), _sequence(v, begin, end),
                                  g_gamma, scale=scale, initial_state=h0, output_final_state=True,
                                  state_v_first=v_first)
        o[begin:end] = o_n[0]
        if not (decode and end == begin):
            expected[slot] = ht[0].to(pool.dtype)
    return o.view(B, T, H, V), expected
