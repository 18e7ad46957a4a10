"""The Lightning GPU test cases, shared by ``tests/gpu/test_lightning_gpu.py`` and by the FLA error measurement
(``benchmarks/fla_lightning_error_bounds.py``), with their inputs, their fp64 oracle and their bounds.

Each case of :data:`CASES` is one ``cula.lightning`` call: a dense prefill (h0 present or absent), the prefill with
FLA's per-layer decay, a pool prefill or a decode over a state pool; H = 4 heads, K = V = 128, bf16 q/k/v, the decays
:data:`GAMMA` (head 0 none, head 3 -8 per token) unless the case names FLA's layer formula.

``make_inputs`` draws every case's values from one generator in a fixed order: q, k, v, then the state (the dense h0
or the pool) when the case has one. The frozen FLA errors (``tests/lightning_fla_errors.py``) are for these very
values: add cases (at the end of a list, under a new name), never reorder or change the draws or a case's fields.

The bound of output ``which`` (0: o, 1: the final state / the pool's written slots) of a case is
``min(1.25 x FLA's error, PROVISIONAL_BOUND)``, never below its floor (:data:`ROUNDING_FLOOR`; the states of a bf16
pool :data:`BF16_POOL_FLOOR`), where FLA's error is recorded. Where FLA's value is NaN (its output was not finite:
FLA 0.6.0's prefill gave non-finite final states on every case with a partial last chunk, on the H100 that measured
the table; not investigated), FLA's error is taken as the largest finite one it had on that output over the cases of
the same op (prefill or decode), plus, for the states of a bf16 pool, two roundings of every element to bf16
(:data:`BF16_ROUNDING`: those cases' siblings hold fp32 states, and ``|r(a) - r(b)| <= |a - b| + |r(a) - a| + |b -
r(b)|``); with no such error, and for a case not measured yet, the bound is :data:`PROVISIONAL_BOUND`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.reference.lightning_pool_oracle import bounds_of, pool_oracle

H, K, V = 4, 128, 128
GAMMA = (0.0, -0.05, -0.5, -8.0)  # per-head log-decay: head 0 no decay, head 3 -8 per token
POOL_SLOTS = 8
FLA_FACTOR = 1.25
PROVISIONAL_BOUND = 2e-2  # where FLA's error is not measured (or not finite): the bound these tests had before
ROUNDING_FLOOR = 1e-6  # a bound never below this: a 1.25x ratio of two fp32 roundings (1-token states) is no measure
# One rounding to bf16 of every element: the rel. L2 of N(0, 1) values rounded to bf16 is 1.66e-3.
BF16_ROUNDING = 1.7e-3
# The states of a bf16 pool: both sides round states that agree to ~4e-8 (fp32) to bf16, and the two roundings differ
# by one bf16 ulp (up to 2^-8 of the element) wherever the exact value lies that close to a rounding boundary (cuLA's
# decode: 0 to 1.2e-5 where FLA's table holds 0). The floor admits such differences on a few tenths of a percent of
# the elements, no more.
BF16_POOL_FLOOR = 1e-4


@dataclass(frozen=True)
class LightningCase:
    """One ``lightning_prefill`` (``op="prefill"``) or ``lightning_decode`` (``op="decode"``) call.

    ``lens``: packed sequence lengths (B == 1, ``cu_seqlens`` int32 for prefill, int64 for decode), or None: B rows
    of T tokens. ``indices``: the pool slots per sequence (a pool call; a slot outside ``[0, POOL_SLOTS)`` is
    padding), with ``has`` (``has_initial_state``, prefill only). ``layer``: ``(layer_idx, num_layers)``, FLA's decay
    formula instead of :data:`GAMMA` (no final state asked). ``h0``: a dense initial state (prefill without a pool).
    """

    name: str
    op: str
    B: int
    T: int
    lens: tuple[int, ...] | None = None
    h0: bool = False
    v_first: bool = False
    indices: tuple[int, ...] | None = None
    has: tuple[bool, ...] | None = None
    pool_dtype: torch.dtype = torch.float32
    layer: tuple[int, int] | None = None

    @property
    def N(self) -> int:
        return self.B if self.lens is None else len(self.lens)

    @property
    def pool(self) -> bool:
        return self.indices is not None

    def written_rows(self) -> list[tuple[int, int]]:
        """``(sequence, slot)`` of each pool slot the call writes: every in-pool slot (decode: of a sequence with
        tokens)."""
        if not self.pool:
            return []
        starts = bounds_of(None if self.lens is None else list(self.lens), self.B, self.T)
        return [(n, s) for n, s in enumerate(self.indices) if 0 <= s < POOL_SLOTS
                and (self.op == "prefill" or starts[n + 1] > starts[n])]

    def written(self) -> list[int]:
        """The pool slots the call writes (:meth:`written_rows`)."""
        return [s for _, s in self.written_rows()]


_LAYOUTS = ((False, "kfirst"), (True, "vfirst"))
_POOLS = ((torch.float32, "fp32-pool"), (torch.bfloat16, "bf16-pool"))

# name: (lens or None, B, T, h0)
_PREFILL = {
    "fixed-B2-T200-h0": (None, 2, 200, True),
    "fixed-B3-T64": (None, 3, 64, False),
    "packed-0-1-64-130-0-257-h0": ((0, 1, 64, 130, 0, 257), 1, 452, True),
    "packed-63-65-tails": ((63, 65), 1, 128, False),
}
# name: (lens or None, B, T, indices, has)
_POOL_PREFILL = {
    "fixed-B4-T80-padding": (None, 4, 80, (6, -1, 0, 99), (True, True, False, True)),
    "packed-0-5-64-200-padding": ((0, 5, 64, 200), 1, 269, (2, 7, -3, 0), None),
}
# name: (lens or None, B, T, indices)
_DECODE = {
    "fixed-B6-T1": (None, 6, 1, (3, -1, 0, 9, 5, 7)),
    "packed-0-1-2-5": ((0, 1, 2, 5), 1, 8, (1, 4, 0, 6)),
    "packed-5-2-0-1-padding": ((5, 2, 0, 1, 3), 1, 11, (2, -1, 3, 6, 100)),
}

PREFILL_CASES: list[LightningCase] = [
    LightningCase(f"prefill-{name}-{tag}", "prefill", B, T, lens, h0=h0, v_first=v_first)
    for name, (lens, B, T, h0) in _PREFILL.items() for v_first, tag in _LAYOUTS
]
LAYER_CASE = LightningCase("prefill-layer3of8-B2-T100", "prefill", 2, 100, layer=(3, 8))
POOL_PREFILL_CASES: list[LightningCase] = [
    LightningCase(f"pool-prefill-{name}-{tag}-{ptag}", "prefill", B, T, lens, v_first=v_first, indices=indices,
                  has=has, pool_dtype=dtype)
    for name, (lens, B, T, indices, has) in _POOL_PREFILL.items() for v_first, tag in _LAYOUTS
    for dtype, ptag in _POOLS
]
DECODE_CASES: list[LightningCase] = [
    LightningCase(f"decode-{name}-{tag}-{ptag}", "decode", B, T, lens, v_first=v_first, indices=indices,
                  pool_dtype=dtype)
    for name, (lens, B, T, indices) in _DECODE.items() for v_first, tag in _LAYOUTS for dtype, ptag in _POOLS
]
CASES: list[LightningCase] = [*PREFILL_CASES, LAYER_CASE, *POOL_PREFILL_CASES, *DECODE_CASES]
BY_NAME: dict[str, LightningCase] = {case.name: case for case in CASES}


def gamma(device: torch.device | str = "cpu") -> torch.Tensor:
    """:data:`GAMMA` as the fp32 ``[H]`` tensor the calls take."""
    return torch.tensor(GAMMA, dtype=torch.float32, device=device)


def layer_gamma(layer_idx: int, num_layers: int) -> torch.Tensor:
    """FLA's per-layer decay ``-(8 / H) (1 - layer_idx / num_layers) h`` (fp32 ``[H]``, on the CPU), for the oracle."""
    return -(8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float32)


def _cu(lens: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(bounds_of(list(lens), 1, 0), dtype=dtype)


def make_inputs(case: LightningCase, device: torch.device | str, seed: int = 0) -> dict:
    """The keyword arguments of ``lightning_prefill`` / ``lightning_decode`` for ``case`` on ``device``.

    Draws (one CPU generator seeded with ``seed``, in this order, never to be changed): q ``[B, T, H, K]`` = 0.5 N(0,
    1), k likewise, v ``[B, T, H, V]`` = N(0, 1), all rounded to bf16; then, where the case has one, the dense h0
    ``[N, H, K, V]`` (``[N, H, V, K]`` if ``v_first``) or the pool ``[POOL_SLOTS, H, K, V]`` (likewise) = 0.3 N(0, 1),
    fp32 (the pool then rounded to ``pool_dtype``). Index tensors: int32 (``cu_seqlens`` int64 for decode)."""
    gen = torch.Generator().manual_seed(seed)
    B, T = case.B, case.T
    q = (0.5 * torch.randn(B, T, H, K, generator=gen)).to(torch.bfloat16)
    k = (0.5 * torch.randn(B, T, H, K, generator=gen)).to(torch.bfloat16)
    v = torch.randn(B, T, H, V, generator=gen).to(torch.bfloat16)
    kwargs: dict = {"q": q, "k": k, "v": v}
    if case.layer is None:
        kwargs["g_gamma"] = gamma()
    else:
        kwargs["layer_idx"], kwargs["num_layers"] = case.layer
    state_shape = (V, K) if case.v_first else (K, V)
    if case.pool:
        kwargs["state"] = (0.3 * torch.randn(POOL_SLOTS, H, *state_shape, generator=gen)).to(case.pool_dtype)
        kwargs["state_indices"] = torch.tensor(case.indices, dtype=torch.int32)
        kwargs["state_v_first"] = case.v_first
        if case.has is not None:
            kwargs["has_initial_state"] = torch.tensor(case.has, dtype=torch.bool)
    elif case.layer is None:
        if case.h0:
            kwargs["initial_state"] = 0.3 * torch.randn(case.N, H, *state_shape, generator=gen)
        kwargs["output_final_state"] = True
        kwargs["state_v_first"] = case.v_first
    if case.lens is not None:
        kwargs["cu_seqlens"] = _cu(case.lens, torch.int64 if case.op == "decode" else torch.int32)
    return {name: (x.to(device) if isinstance(x, torch.Tensor) else x) for name, x in kwargs.items()}


def case_gamma(case: LightningCase, kwargs: dict) -> torch.Tensor:
    """The decay the call runs with, fp32 ``[H]`` on the CPU."""
    return kwargs["g_gamma"].cpu() if case.layer is None else layer_gamma(*case.layer)


def start_states(case: LightningCase, kwargs: dict) -> torch.Tensor | None:
    """Each sequence's start state as one dense fp32 ``[N, H, ...]`` tensor on the inputs' device (FLA's dense form
    of a pool call: the slot's state, zeros for padding rows and where ``has`` is False), or the dense h0."""
    if not case.pool:
        return kwargs.get("initial_state")
    pool = kwargs["state"]
    h0 = torch.zeros(case.N, *pool.shape[1:], dtype=torch.float32, device=pool.device)
    for n, slot in enumerate(case.indices):
        if 0 <= slot < POOL_SLOTS and (case.has is None or case.has[n]):
            h0[n] = pool[slot].float()
    return h0


def oracle(case: LightningCase, kwargs: dict, pool_before: torch.Tensor | None = None,
           final_state: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float64 o ``[B, T, H, V]`` and the expected states on the CPU: the final states ``[N, H, ...]`` of a dense
    call (None for the layer case, unless ``final_state``), the pool's expected contents after a pool call (from
    ``pool_before``, default ``kwargs["state"]``, which must be the pool as it was before the call)."""
    from cula_runtime.reference.lightning import lightning_naive

    q, k, v = (kwargs[n].cpu() for n in ("q", "k", "v"))
    g = case_gamma(case, kwargs)
    lens = None if case.lens is None else list(case.lens)
    if case.pool:
        before = kwargs["state"] if pool_before is None else pool_before
        return pool_oracle(q, k, v, g, None, before.cpu(), list(case.indices), lens, v_first=case.v_first,
                           decode=case.op == "decode", has_initial_state=None if case.has is None else list(case.has))
    h0 = kwargs.get("initial_state")
    cu = kwargs.get("cu_seqlens")
    o, ht = lightning_naive(q, k, v, g, initial_state=None if h0 is None else h0.cpu(),
                            output_final_state=case.layer is None if final_state is None else final_state,
                            cu_seqlens=None if cu is None else cu.cpu(),
                            state_v_first=case.v_first)
    return o, ht


def _fla_errors() -> dict:
    try:
        from tests.lightning_fla_errors import LIGHTNING_FLA_ERRORS
    except ImportError:
        return {}
    return LIGHTNING_FLA_ERRORS


def _bf16_pool_states(name: str, which: int) -> bool:
    case = BY_NAME.get(name)
    return which == 1 and case is not None and case.pool and case.pool_dtype == torch.bfloat16


def _largest_finite_of_the_op(name: str, which: int, table: dict) -> float | None:
    """FLA's largest finite error on output ``which`` over the table's cases of case ``name``'s op (None: none)."""
    case = BY_NAME.get(name)
    if case is None:
        return None
    finite = [errors[which] for other, errors in table.items()
              if other in BY_NAME and BY_NAME[other].op == case.op and math.isfinite(errors[which])]
    return max(finite, default=None)


def bound(name: str, which: int, errors: dict | None = None) -> float:
    """The accepted rel. L2 error of output ``which`` (0: o, 1: the states) of case ``name``: 1.25 x FLA's frozen
    error, never above :data:`PROVISIONAL_BOUND`, never below the output's floor (:data:`ROUNDING_FLOOR`,
    :data:`BF16_POOL_FLOOR`); where FLA's error is NaN, its largest finite one on that output over the same op's
    cases (plus 2 x :data:`BF16_ROUNDING` for a bf16 pool's states); :data:`PROVISIONAL_BOUND` for a case not
    measured or with no such error. ``errors``: the frozen table (default: tests/lightning_fla_errors.py)."""
    if which not in (0, 1):
        raise ValueError(f"which must be 0 (o) or 1 (the states), got {which!r}")
    table = _fla_errors() if errors is None else errors
    measured = table.get(name)
    if measured is None:
        return PROVISIONAL_BOUND
    bf16_pool = _bf16_pool_states(name, which)
    if math.isfinite(measured[which]):
        accepted = FLA_FACTOR * measured[which]
    else:
        sibling = _largest_finite_of_the_op(name, which, table)
        if sibling is None:
            return PROVISIONAL_BOUND
        accepted = FLA_FACTOR * sibling + (2 * BF16_ROUNDING if bf16_pool else 0.0)
    return max(min(accepted, PROVISIONAL_BOUND), BF16_POOL_FLOOR if bf16_pool else ROUNDING_FLOOR)
