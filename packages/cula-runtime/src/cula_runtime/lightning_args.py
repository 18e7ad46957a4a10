"""Validation of ``lightning_prefill`` and ``lightning_decode`` arguments: the one validator of each op, shared by
every backend (issue 28; the math: KDA_SPEC §5).

``validate_lightning_prefill`` / ``validate_lightning_decode`` check every argument before any backend sees it and
raise ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, size or value) naming the argument and the
value expected. They return a frozen :class:`LightningPrefillArgs` / :class:`LightningDecodeArgs`. The checks shared
with KDA are imported from :mod:`cula_runtime.kda_args` (flags, scale, ``cu_seqlens``' shape and values, the state
pool) and :mod:`cula_runtime.state_pool` (the slot rules).

The decay. Either ``g_gamma`` (``[H]`` fp32, each entry finite and ``<= 0``: the per-token log-decay of head h) or
FLA's ``layer_idx`` / ``num_layers`` form, ``g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h`` (head 0
has no decay), built once per ``(H, layer_idx, num_layers, device)`` and kept (:func:`layer_g_gamma`: no allocation
per call). A CPU ``g_gamma``'s values are checked (finite, ``<= 0``); a GPU one's are trusted (reading them would
synchronise with the device): a positive or non-finite entry there gives a meaningless (growing or NaN) result.

Synchronisation: the prefill checks ``cu_seqlens``' values on every call (one copy to the host per tensor and
version, cached: :func:`cula_runtime.kda_args.checked_boundaries`), as ``kda_prefill`` does. The decode reads no
device value (a CUDA graph replays it with new values in the same buffers): ``cu_seqlens`` and ``state_indices`` are
checked when they are CPU tensors, and on a GPU what the kernels meet out of range is padding. The prefill's
``state_indices`` likewise: checked on the host (strict: a slot ``>= P`` or a slot named twice is a ``ValueError``)
for CPU tensors only.

Strides: non-contiguous q, k, v (and ``initial_state``, ``g_gamma``, the index tensors) are copied to contiguous
tensors here, once; the pool ``state`` and ``out`` are written in place and never copied (each pool slot must be
dense, the slot stride is free; ``out`` must be contiguous).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .graph_pools import built_outside_graph_pools
from .kda_args import (
    _dtype,
    _shape,
    _tensor,
    check_apart,
    check_decode_cu_seqlens,
    check_flags,
    check_has_initial_state,
    check_out,
    check_packed_cu_seqlens,
    check_pool_form,
    check_scale,
    check_state_pool,
    checked_boundaries,
    sequence_lengths,
    type_name,
)
from .state_pool import PoolSlots, pool_slots

__all__ = ["LightningPrefillArgs", "LightningDecodeArgs", "validate_lightning_prefill", "validate_lightning_decode",
           "layer_g_gamma", "resolve_g_gamma", "lightning_pool_slots", "check_lightning_inputs", "MAX_HEAD_DIM"]

MAX_HEAD_DIM = 256
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_POOL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class LightningPrefillArgs:
    """Validated ``lightning_prefill`` arguments (see ``cula.lightning.lightning_prefill``).

    q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` contiguous in one dtype (bf16, fp16, fp32); ``g_gamma`` ``[H]``
    fp32 contiguous on q's device (finite, ``<= 0``); ``scale`` resolved; ``initial_state`` fp32 contiguous
    ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``) or None; ``cu_seqlens`` int32/int64 ``[N + 1]`` with
    checked boundaries (then ``B == 1``) or None; the pool form: ``state`` ``[P, H, K, V]`` (``[P, H, V, K]``), fp32 or
    bf16, as passed (written in place), ``state_indices`` int32 ``[N]``, ``has_initial_state`` bool ``[N]`` or None
    (all True). ``N`` = ``B`` without ``cu_seqlens``, else ``len(cu_seqlens) - 1``.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g_gamma: torch.Tensor
    scale: float
    initial_state: torch.Tensor | None
    output_final_state: bool
    cu_seqlens: torch.Tensor | None
    state_v_first: bool
    state: torch.Tensor | None
    state_indices: torch.Tensor | None
    has_initial_state: torch.Tensor | None
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int

    @property
    def device(self) -> torch.device:
        """q's device (every tensor argument is on it)."""
        return self.q.device

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """Shape of ``initial_state`` / the final state: ``[N, H, K, V]``, or ``[N, H, V, K]`` if V-first."""
        return (self.N, self.H, self.V, self.K) if self.state_v_first else (self.N, self.H, self.K, self.V)


@dataclass(frozen=True)
class LightningDecodeArgs:
    """Validated ``lightning_decode`` arguments (see ``cula.lightning.lightning_decode``).

    q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` contiguous in one dtype; ``g_gamma`` ``[H]`` fp32 contiguous; ``state``
    the pool ``[P, H, K, V]`` (``[P, H, V, K]`` with ``state_v_first``), fp32 or bf16, as passed (in place);
    ``state_indices`` int32 ``[N]``; ``cu_seqlens`` int32/int64 ``[N + 1]`` (``B == 1``) or None (``N = B``
    sequences of ``T`` tokens); ``out`` ``[B, T, H, V]`` in q's dtype, contiguous, as passed, or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g_gamma: torch.Tensor
    scale: float
    state: torch.Tensor
    state_indices: torch.Tensor
    state_v_first: bool
    cu_seqlens: torch.Tensor | None
    out: torch.Tensor | None
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int

    @property
    def device(self) -> torch.device:
        """q's device (every tensor argument is on it)."""
        return self.q.device

    @property
    def P(self) -> int:
        """The pool's slot count."""
        return self.state.shape[0]


# ---- the decay ----------------------------------------------------------------------------------------------------

_layer_gammas: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}


def _index(name: str, x: object) -> int:
    """``x`` as an int: a Python or NumPy integer, not a bool."""
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type_name(x)}")
    return int(x)


def layer_g_gamma(H: int, layer_idx: int, num_layers: int, device: torch.device | str) -> torch.Tensor:
    """FLA's decay of layer ``layer_idx`` of ``num_layers`` (``fla.ops.lightning_attn``):
    ``g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h``, fp32 ``[H]`` on ``device`` (head 0: no decay).

    Built once per ``(H, layer_idx, num_layers, device)`` and returned from then on (the same tensor: do not write
    to it). The arguments are not checked here (:func:`resolve_g_gamma` does)."""
    device = torch.device(device)
    key = (H, layer_idx, num_layers, device)
    gamma = _layer_gammas.get(key)
    if gamma is None:
        # the product as FLA forms it: a Python float times an fp32 arange (kept: never in a CUDA graph's pool)
        host = -(8 / H * (1 - layer_idx / num_layers)) * torch.arange(H, dtype=torch.float32)
        gamma = built_outside_graph_pools(device, lambda: host.to(device))
        _layer_gammas[key] = gamma
    return gamma


def resolve_g_gamma(g_gamma: object, layer_idx: object, num_layers: object, H: int,
                    device: torch.device) -> torch.Tensor:
    """The decay as an fp32 ``[H]`` tensor on ``device``: ``g_gamma`` checked (a CPU one's values too), or the
    ``layer_idx`` / ``num_layers`` form (:func:`layer_g_gamma`). ``TypeError``/``ValueError`` naming the argument:
    both forms given, neither, one of ``layer_idx`` / ``num_layers`` without the other, ``layer_idx`` outside
    ``[0, num_layers)``, a ``g_gamma`` of the wrong type, dtype, shape or device, or a CPU one with an entry that is
    not finite or is ``> 0``."""
    if g_gamma is not None:
        if layer_idx is not None or num_layers is not None:
            raise ValueError("pass either g_gamma or layer_idx/num_layers (FLA's decay of a layer), not both; got "
                             f"g_gamma and layer_idx={layer_idx!r}, num_layers={num_layers!r}")
        g_gamma = _tensor("g_gamma", g_gamma)
        if g_gamma.dtype != torch.float32:
            raise TypeError(f"g_gamma must have dtype torch.float32, got {g_gamma.dtype}")
        if g_gamma.shape != (H,):
            _shape("g_gamma", g_gamma, (H,), "[H], one log-decay per head")
        if g_gamma.device != device:
            raise ValueError(f"g_gamma must be on q's device ({device}), got {g_gamma.device}")
        if g_gamma.device.type == "cpu":  # (on a GPU the values are trusted: reading them would synchronise)
            bad = ~(torch.isfinite(g_gamma) & (g_gamma <= 0))
            if bool(bad.any()):
                h = int(bad.nonzero()[0, 0])
                raise ValueError(f"g_gamma must be finite and <= 0 (a log-decay), got g_gamma[{h}]="
                                 f"{float(g_gamma[h])}")
        return g_gamma.contiguous()
    if layer_idx is None and num_layers is None:
        raise ValueError("the decay is missing: pass g_gamma (fp32 [H], <= 0) or layer_idx and num_layers (FLA's "
                         "g_gamma[h] = -(8 / H) * (1 - layer_idx / num_layers) * h)")
    if layer_idx is None or num_layers is None:
        missing = "layer_idx" if layer_idx is None else "num_layers"
        raise ValueError(f"layer_idx and num_layers go together (FLA's decay of a layer): {missing} is missing")
    layer_idx = _index("layer_idx", layer_idx)
    num_layers = _index("num_layers", num_layers)
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx must be in [0, num_layers) = [0, {num_layers}), got {layer_idx}")
    return layer_g_gamma(H, layer_idx, num_layers, device)


# ---- the inputs ---------------------------------------------------------------------------------------------------

def check_lightning_inputs(q: object, k: object, v: object) -> tuple[int, int, int, int, int]:
    """q, k ``[B, T, H, K]`` and v ``[B, T, H, V]`` tensors of one dtype (bf16, fp16, fp32) on one device, ``H``,
    ``K``, ``V`` >= 1 (head dims <= 256); returns ``(B, T, H, K, V)``."""
    q, k, v = _tensor("q", q), _tensor("k", k), _tensor("v", v)
    if q.ndim != 4:
        raise ValueError(f"q must be 4-D [B, T, H, K], got shape {list(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        _shape("k", k, (B, T, H, K), "the shape of q: [B, T, H, K]")
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v must have shape [B={B}, T={T}, H={H}, V] (q's heads: Lightning has no GVA), got "
                         f"{list(v.shape)}")
    V = v.shape[3]
    if H == 0:
        raise ValueError(f"the head count H (q.shape[2]) must be >= 1, got {H}")
    for name, size in (("K (q.shape[-1])", K), ("V (v.shape[-1])", V)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(f"head dim {name} must be in [1, {MAX_HEAD_DIM}], got {size}")
    if q.dtype not in _INPUT_DTYPES:
        _dtype("q", q, _INPUT_DTYPES)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name} must be on q's device ({q.device}), got {x.device}")
    return B, T, H, K, V


def _check_optional_devices(device: torch.device, optional: tuple[tuple[str, object], ...]) -> None:
    """Each ``(name, tensor or None)``: a tensor on ``device`` (``TypeError`` / ``ValueError`` naming it)."""
    for name, x in optional:
        if x is None:
            continue
        _tensor(name, x)
        if x.device != device:
            raise ValueError(f"{name} must be on q's device ({device}), got {x.device}")


def _check_pool(state: object, state_indices: object, N: int, H: int, K: int, V: int, state_v_first: bool) -> int:
    """The pool ``[P, H, K, V]`` (``[P, H, V, K]``) in fp32 or bf16 with dense slots and int32 ``[N]`` indices
    (:func:`cula_runtime.kda_args.check_state_pool`); returns ``P``."""
    P, _ = check_state_pool(state, state_indices, N, H, K, V, state_v_first, per_token_allowed=False, heads="H")
    if state.dtype not in _POOL_DTYPES:
        _dtype("state", state, _POOL_DTYPES)
    return P


def lightning_pool_slots(state_indices: torch.Tensor, lens: list[int], P: int, *, strict: bool) -> PoolSlots:
    """The slots a call's sequences use (:func:`cula_runtime.state_pool.pool_slots`, one slot per sequence), from
    ``state_indices``' values (one copy to the host: a synchronisation for a GPU tensor). ``strict``: a slot
    ``>= P`` is a ``ValueError`` (else padding, as on the device); a slot named twice is one either way."""
    return pool_slots(state_indices.tolist(), lens, P, per_token=False, strict=strict)


# ---- the validators -----------------------------------------------------------------------------------------------

def validate_lightning_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor | None = None,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> LightningPrefillArgs:
    """Check every ``lightning_prefill`` argument (see ``cula.lightning.lightning_prefill`` for their meaning); the
    checks run in a fixed order and the first failing one raises ``TypeError`` or ``ValueError`` naming its argument.
    ``cu_seqlens``' values are checked (one synchronisation per tensor and version on a GPU), CPU ``state_indices``'
    too (strict slot rules)."""
    B, T, H, K, V = check_lightning_inputs(q, k, v)
    check_flags(("output_final_state", "state_v_first"), (output_final_state, state_v_first))
    device = q.device
    pooled = state is not None or state_indices is not None or has_initial_state is not None
    _check_optional_devices(device, (("initial_state", initial_state), ("cu_seqlens", cu_seqlens), ("state", state),
                                     ("state_indices", state_indices), ("has_initial_state", has_initial_state)))
    gamma = resolve_g_gamma(g_gamma, layer_idx, num_layers, H, device)
    scale = check_scale(scale, K)

    cu_host = None
    if cu_seqlens is not None:
        N = check_packed_cu_seqlens(cu_seqlens, B)
        cu_host = checked_boundaries(cu_seqlens, None, T)
    else:
        N = B

    state_shape = (N, H, V, K) if state_v_first else (N, H, K, V)
    if initial_state is not None:
        if initial_state.shape != state_shape:
            dims = "[N, H, V, K]" if state_v_first else "[N, H, K, V]"
            _shape("initial_state", initial_state, state_shape, f"{dims}, state_v_first={state_v_first}")
        if initial_state.dtype != torch.float32:
            raise TypeError(f"initial_state must have dtype torch.float32, got {initial_state.dtype}")

    if pooled:
        check_pool_form(state, state_indices, initial_state, output_final_state, heads="H")
        P = _check_pool(state, state_indices, N, H, K, V, state_v_first)
        check_has_initial_state(has_initial_state, N)
        check_apart((("state", state),), (("q", q), ("k", k), ("v", v), ("g_gamma", gamma), ("cu_seqlens", cu_seqlens),
                                          ("state_indices", state_indices), ("has_initial_state", has_initial_state)))
        if state_indices.device.type == "cpu":  # (GPU values are never read here: out of range is padding)
            lightning_pool_slots(state_indices, sequence_lengths(N, T, cu_host), P, strict=True)

    return LightningPrefillArgs(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g_gamma=gamma, scale=scale,
        initial_state=None if initial_state is None else initial_state.contiguous(),
        output_final_state=output_final_state, cu_seqlens=None if cu_seqlens is None else cu_seqlens.contiguous(),
        state_v_first=state_v_first, state=state,
        state_indices=None if state_indices is None else state_indices.contiguous(),
        has_initial_state=None if has_initial_state is None else has_initial_state.contiguous(),
        B=B, T=T, H=H, K=K, V=V, N=N,
    )


def validate_lightning_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_gamma: torch.Tensor | None = None,
    layer_idx: int | None = None,
    num_layers: int | None = None,
    scale: float | None = None,
    *,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    state_v_first: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> LightningDecodeArgs:
    """Check every ``lightning_decode`` argument (see ``cula.lightning.lightning_decode``); the first failing check
    raises ``TypeError`` or ``ValueError`` naming its argument. No device value is read: ``cu_seqlens`` and
    ``state_indices`` are checked by value when they are CPU tensors only (strict slot rules)."""
    B, T, H, K, V = check_lightning_inputs(q, k, v)
    check_flags(("state_v_first",), (state_v_first,))
    device = q.device
    if state is None:
        raise ValueError("state (the pool [P, H, K, V] decode reads and writes in place) is required")
    _check_optional_devices(device, (("state", state), ("state_indices", state_indices), ("cu_seqlens", cu_seqlens),
                                     ("out", out)))
    gamma = resolve_g_gamma(g_gamma, layer_idx, num_layers, H, device)
    scale = check_scale(scale, K)

    N, cu_host = check_decode_cu_seqlens(cu_seqlens, B, T)

    P = _check_pool(state, state_indices, N, H, K, V, state_v_first)

    check_out(out, q, (B, T, H, V), "[B, T, H, V]")
    check_apart((("state", state), ("out", out)), (("q", q), ("k", k), ("v", v), ("g_gamma", gamma),
                                                   ("state_indices", state_indices), ("cu_seqlens", cu_seqlens)))

    if state_indices.device.type == "cpu":
        lightning_pool_slots(state_indices, sequence_lengths(N, T, cu_host), P, strict=True)

    return LightningDecodeArgs(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g_gamma=gamma, scale=scale, state=state,
        state_indices=state_indices.contiguous(), state_v_first=state_v_first,
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.contiguous(), out=out, B=B, T=T, H=H, K=K, V=V, N=N,
    )
