"""The state-pool tests' inputs and oracle: each sequence run alone by the fp64 recurrence (``kda_naive``) from its
slot, the pool's expected contents built by applying its writes in order (KDA_SPEC §10)."""

from __future__ import annotations

import torch

from cula_runtime.reference.kda_naive import kda_naive

H, HV, K, V = 2, 4, 16, 8

#: gate forms: keyword arguments of the call, and how g is drawn ("bounded": in [-5, 0]; "unbounded": any <= 0,
#: down to -1000; "raw": the pre-activation of the in-kernel gate)
GATES = {
    "precomputed-bounded": ({}, "bounded"),
    "precomputed-unbounded": ({}, "unbounded"),
    "lower-bound-in-kernel": (dict(use_gate_in_kernel=True, lower_bound=-5.0, use_beta_sigmoid_in_kernel=True,
                                   allow_neg_eigval=True), "raw"),
    "softplus-in-kernel": (dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True,
                                use_beta_sigmoid_in_kernel=True), "raw"),
}


def make_inputs(gate: str, B: int, T: int, *, seed: int, h: int = H, hv: int = HV, dtype: torch.dtype = torch.float32,
                cu: list[int] | None = None) -> dict:
    """q, k, v, g, beta (``[B, T, ...]``; ``cu``: packed, ``B = 1``) and the gate form's flags and parameters."""
    flags, kind = GATES[gate]
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    kwargs = dict(q=r(B, T, h, K).to(dtype), k=r(B, T, h, K).to(dtype), v=r(B, T, hv, V).to(dtype), **flags)
    if not flags.get("use_qk_l2norm_in_kernel"):  # keep the rank-1 updates moderate without the norm
        kwargs["q"], kwargs["k"] = kwargs["q"] * 0.3, kwargs["k"] * 0.3
    if kind == "bounded":
        g = -5.0 * torch.sigmoid(r(B, T, hv, K))
    elif kind == "unbounded":
        g = -torch.exp(2.0 * r(B, T, hv, K))
        g[..., ::5] = -1000.0  # exp underflows to 0
    else:
        g = r(B, T, hv, K)
        kwargs["A_log"] = 0.3 * r(hv)
        kwargs["dt_bias"] = 0.5 * r(hv * K)
    kwargs["g"] = g
    if flags.get("use_beta_sigmoid_in_kernel"):
        kwargs["beta"] = r(B, T, hv).bfloat16()  # logits, bf16
    else:
        kwargs["beta"] = torch.rand(B, T, hv, generator=gen)
    if cu is not None:
        kwargs["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    return kwargs


def make_pool(P: int, *, seed: int, v_first: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A pool of random states whose values are bf16-representable (so one pool serves fp32 and bf16 runs)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (P, HV, V, K) if v_first else (P, HV, K, V)
    return (0.5 * torch.randn(*shape, generator=gen)).bfloat16().to(dtype)


_NAIVE_KEYS = ("scale", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
               "allow_neg_eigval", "lower_bound", "A_log", "dt_bias")


def _sequence(kwargs: dict, n: int, lens: list[int]) -> dict:
    """Sequence ``n``'s tokens alone, ``[1, T_n, ...]``."""
    cu = kwargs.get("cu_seqlens")
    parts = {}
    for name in ("q", "k", "v", "g", "beta"):
        x = kwargs[name]
        if cu is None:
            parts[name] = x[n:n + 1]
        else:
            begin = int(cu[n])
            parts[name] = x[:, begin:begin + lens[n]]
    return parts


def oracle(kwargs: dict, pool: torch.Tensor, indices: list, lens: list[int], *, v_first: bool,
           accepted: list[int] | None = None, has_initial: list[bool] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, pool after the call)`` in fp64: each sequence by ``kda_naive`` from its start slot (the rules of
    ``cula_runtime.state_pool`` for in-range values); ``indices`` ``[N]`` or ``[N][W]`` as Python ints."""
    flags = {key: kwargs[key] for key in _NAIVE_KEYS if key in kwargs}
    B, T = kwargs["q"].shape[:2]
    o = torch.zeros(B, T, *kwargs["v"].shape[2:], dtype=torch.float64)
    before = pool.double()
    after = before.clone()
    cu = kwargs.get("cu_seqlens")
    for n, entry in enumerate(indices):
        per_token = isinstance(entry, list)
        start = entry[(accepted[n] - 1) if accepted is not None else 0] if per_token else entry
        if start < 0:
            continue
        parts = _sequence(kwargs, n, lens)
        h0 = before[start:start + 1]
        if has_initial is not None and not has_initial[n]:
            h0 = torch.zeros_like(h0)
        o_n, ht = kda_naive(**parts, **flags, initial_state=h0, output_final_state=True, state_v_first=v_first)
        if cu is None:
            o[n] = o_n[0]
        else:
            begin = int(cu[n])
            o[0, begin:begin + lens[n]] = o_n[0]
        if not per_token:  # (a length-0 sequence: its start state, or zeros without an initial state)
            after[entry] = ht[0]
            continue
        for t in range(lens[n]):
            if entry[t] >= 0:
                prefix = {name: x[:, :t + 1] for name, x in parts.items()}
                _, h_t = kda_naive(**prefix, **flags, initial_state=h0, output_final_state=True,
                                   state_v_first=v_first)
                after[entry[t]] = h_t[0]
    return o, after


def untouched(P: int, indices: list, lens: list[int], accepted: list[int] | None = None) -> list[int]:
    """The slots no sequence writes (a length-0 sequence writes nothing in decode)."""
    written = set()
    for n, entry in enumerate(indices):
        if isinstance(entry, list):
            start = entry[(accepted[n] - 1) if accepted is not None else 0]
            if start >= 0:
                written |= {s for s in entry[:lens[n]] if s >= 0}
        elif entry >= 0 and lens[n] > 0:
            written.add(entry)
    return [p for p in range(P) if p not in written]
