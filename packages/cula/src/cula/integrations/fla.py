"""cuLA as a backend of FLA's registry (fla-core >= 0.6.0): FLA's ``chunk_kda`` and its KDA decode entry
``fused_recurrent_kda_fwd`` run on cuLA for every call cuLA serves on the tensors' device; FLA runs its own kernels
for the others, and logs why cuLA declined (``[FLA Backend] ... -> cula rejected: <reason>``, logger
``fla.backends``, level INFO, once per entry point).

Registration: ``import cula`` registers this backend by itself once FLA's KDA ops are imported
(:func:`cula.integrations.autoregister_fla`); :func:`register` does it explicitly (it imports FLA's KDA ops).
Enabled by default; ``FLA_CULA=0`` switches it off (FLA reads the variable on every call). Priority 2: ahead of
FLA's FlashKDA backend (3) where both are installed; ``FLA_FLASH_KDA=0`` or ``FLA_CULA=0`` picks one.

What cuLA serves, and declines with a reason:

- ``chunk_kda`` (the calls of :func:`cula.kda.kda_prefill`): calls with no gradient to track (no input requires grad,
  or grad mode off) that cuLA's validator accepts and that, on a GPU, a GPU backend serves (a call that would fall
  back to cuLA's torch reference on a GPU is declined: FLA's Triton kernels are faster). On the CPU (where FLA's
  Triton kernels cannot run) every valid call runs on cuLA's torch reference. Declined: ``return_intermediate_states``
  (cuLA returns no per-chunk states), ``cp_context`` (no context parallelism), ``use_graph`` (cuLA builds a packed
  batch's chunk indices on the host, so a captured graph cannot be replayed with new ``cu_seqlens``), a non-fp32
  ``initial_state`` and a ``chunk_size`` other than 32 or 64 (FLA's own checks refuse both), and any keyword cuLA
  does not know. Mapped: the deprecated ``transpose_state_layout`` to ``state_v_first`` (as FLA maps it; both
  given: declined, FLA refuses the pair), int64 ``cu_seqlens`` and
  ``cu_seqlens_cpu`` (FLA's LongTensors) to int32 copies, cached per tensor and version (so a model's layers
  sharing one ``cu_seqlens`` share one copy and cuLA's caches); ``cu_seqlens_cpu`` is served (cuLA checks and
  indexes from it, no synchronisation); ``A_log``/``dt_bias``/``lower_bound`` only with ``use_gate_in_kernel``
  (FLA ignores them otherwise); ``chunk_size`` and ``disable_recompute`` are ignored (FLA's tiling and backward).
  Returned: ``(o, final_state)`` as FLA's (``final_state`` None without ``output_final_state``).
- ``fused_recurrent_kda_fwd`` (FLA's KDA decode, the calls of :func:`cula.kda.kda_decode`): with
  ``ssm_state_indices`` and ``inplace_final_state=True``, ``initial_state`` is the pool and the indices its slots
  (``[N]``: one token per sequence, as FLA's kernel assumes; ``[N, W]`` with ``num_accepted_tokens``: speculative
  verification); without indices, ``initial_state`` is updated in place per sequence (``inplace_final_state=True``)
  or, with ``inplace_final_state=False`` (FLA's ``fused_recurrent_kda``), a new fp32 final state is returned (cuLA
  runs on a copy, without autograd history, as FLA's). int64 indices and counts are narrowed to int32 (one copy
  each per call); ``out`` is written in place. Declined: ``ssm_state_indices`` with ``inplace_final_state=False``
  (FLA then writes each token's state to a new tensor's row ``bos + t``, a layout cuLA does not produce), ``[N]``
  indices with more than one token per sequence (FLA writes token ``t``'s state to ``ssm_state_indices[n + t]``;
  known from a CPU ``cu_seqlens``, and on a GPU from more tokens than sequences: a GPU batch of at most one token
  per sequence on average is taken as a decode step's), an ``initial_state`` of another shape than one state per
  sequence (``inplace_final_state=False``), per-channel ``beta``, and what cuLA's
  validator refuses (an ``initial_state`` of FLA's ``inplace_final_state`` without one, an in-kernel gate without
  ``A_log`` or ``lower_bound``...); on a GPU, calls no GPU decode kernel serves. Returned: ``(o, final_state)``,
  ``final_state`` the pool itself in place.
"""

from __future__ import annotations

import operator
import threading

import torch

try:
    from fla.backends import BaseBackend
    from fla.backends import register as _fla_register
except ImportError as error:  # (no FLA, or one older than its backend registry)
    raise ImportError('cula.integrations.fla needs FLA\'s backend registry (fla-core >= 0.6.0): pip install '
                      '"fla-core>=0.6.0"') from error

from cula_runtime.index import cached_on_version, is_integer_dtype
from cula_runtime.kda_args import validate_kda_prefill
from cula_runtime.kda_decode_args import validate_kda_decode

from ..call_plans import LaunchDeclined, call_signature, decode_call_signature, lookup, lookup_guarded
from ..dispatch import explain, explain_decode
from ..kda import kda_decode, kda_prefill, run_prefill_plan

__all__ = ["CulaBackend", "ENV_SWITCH", "PRIORITY", "register"]

#: FLA's switch of this backend ("0": off); FLA reads it on every call
ENV_SWITCH = "FLA_CULA"
#: FLA's backend priority (lower runs first): ahead of FlashKDA (3) and the TileLang backends (5)
PRIORITY = 2

_CHUNK_KWARGS = frozenset({"A_log", "dt_bias", "chunk_size"})  # chunk_kda's **kwargs cuLA maps
_Tensor = torch.Tensor
_is = operator.is_


def register() -> None:
    """Register :class:`CulaBackend` for FLA's ``chunk_kda`` and its ``kda`` operations (``fused_recurrent_kda_fwd``).

    Imports FLA's KDA ops (seconds, the first time in a process); registering again replaces the earlier
    registration (FLA keys backends by type). ``import cula`` calls this by itself once FLA's KDA ops are imported;
    call it yourself only to register at a chosen point, or to see an error the automatic registration warned of.

    Raises:
        ImportError: FLA (fla-core >= 0.6.0) is not installed, or its KDA ops fail to import.
        KeyError: this FLA's ``chunk_kda`` is not a dispatched entry point of its registry.
    """
    import fla.ops.kda.fused_recurrent  # noqa: F401  (defines the "kda" operations' registry)
    from fla.ops.kda.chunk import chunk_kda

    _fla_register(chunk_kda)(CulaBackend)
    _fla_register("kda")(CulaBackend)


_INT32_MAX = 2**31 - 1


def _int32(x: object) -> object:
    """An int64 ``cu_seqlens`` as an int32 copy, cached as cuLA caches what it derives from ``cu_seqlens`` (a CPU
    one on its values, a GPU one on its identity and version: :mod:`cula_runtime.index`), so that cuLA's caches see
    one tensor per ``cu_seqlens``; anything else as it is (the validator judges it). Not cached while a CUDA graph
    is captured (the copy would be filled only when the graph is replayed)."""
    if x.__class__ is not _Tensor or x.dtype != torch.int64 or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return _int32_each_call(x)
    return cached_on_version("int32 copy of an FLA index", x, None, lambda: x.to(torch.int32))


def _int32_each_call(x: object) -> object:
    """An int64 index tensor (slots, accepted counts: new values every step, which a graph replay or a foreign
    kernel may write without torch's version counter seeing it) as a fresh int32 copy on every call, its values
    first clamped to ``[-1, 2**31 - 1]`` (on the device: no value is read) so that none wraps onto another slot: a
    slot past int32 stays past the pool (padding on a GPU, refused on the CPU), a negative one stays padding;
    anything else as it is."""
    if x.__class__ is not _Tensor or x.dtype != torch.int64:
        return x
    return x.clamp(-1, _INT32_MAX).to(torch.int32)


def _state_layout(state_v_first: object, kwargs: dict) -> object:
    """``state_v_first``, or FLA's deprecated ``transpose_state_layout`` (taken out of ``kwargs``) in its place, as
    FLA maps it; why cuLA declines where both are given (FLA raises)."""
    if "transpose_state_layout" not in kwargs:
        return state_v_first
    if state_v_first:
        return "both state_v_first and the deprecated transpose_state_layout: FLA refuses the pair"
    return kwargs.pop("transpose_state_layout")


def _needs_grad(*tensors: object) -> bool:
    """Whether grad mode is on and any of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(getattr(x, "requires_grad", False) for x in tensors)


def _prefill_call(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                  allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                  return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                  cp_context=None, use_graph=False, max_num_seqs=None, **kwargs) -> tuple | str:
    """FLA's ``chunk_kda`` arguments (its signature; ``disable_recompute`` and ``max_num_seqs`` concern its backward
    and tiling only) as :func:`cula.kda.kda_prefill`'s positional ones, or why cuLA declines."""
    if return_intermediate_states:
        return "return_intermediate_states=True: cuLA returns no per-chunk states h"
    if cp_context is not None:
        return "cp_context: cuLA has no context-parallel form"
    if use_graph:
        return ("use_graph=True: cuLA builds a packed batch's chunk indices on the host for each new cu_seqlens, so "
                "a CUDA graph captured with them cannot be replayed with new cu_seqlens values")
    state_v_first = _state_layout(state_v_first, kwargs)
    if isinstance(state_v_first, str):
        return state_v_first
    if kwargs and not kwargs.keys() <= _CHUNK_KWARGS:
        return f"argument(s) cuLA has no equivalent of: {', '.join(sorted(kwargs.keys() - _CHUNK_KWARGS))}"
    chunk_size = kwargs.get("chunk_size", 64)
    if chunk_size not in (32, 64):
        return f"chunk_size={chunk_size!r}: FLA refuses anything but 32 or 64"
    if initial_state is not None and getattr(initial_state, "dtype", None) != torch.float32:
        return "initial_state is not fp32, which FLA's chunk_kda refuses"
    if use_gate_in_kernel:
        A_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
    else:  # (FLA ignores the gate parameters without the in-kernel gate)
        A_log = dt_bias = lower_bound = None
    if _needs_grad(q, k, v, g, beta, initial_state, A_log, dt_bias):
        return "an input requires grad: cuLA serves inference only (it has no backward)"
    if cu_seqlens is None:
        cu_seqlens_cpu = None  # (FLA reads it only with cu_seqlens)
    else:
        cu_seqlens = _int32(cu_seqlens)
        cu_seqlens_cpu = _int32(cu_seqlens_cpu)
    return (q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
            use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, cu_seqlens,
            state_v_first, cu_seqlens_cpu)


# The last call an entry's verifier accepted by its plan, per thread: ((FLA's positional arguments, its keyword
# arguments), cuLA's call, the plan). FLA calls the implementation right after the verifier with the same objects:
# the implementation then runs that plan without deriving the call and its signature again.
_verified = threading.local()


def _same_call(a: tuple[tuple, dict], b: tuple[tuple, dict]) -> bool:
    """Whether two calls got the same objects (by identity) at the same places and keywords, the keywords in the same
    order (FLA passes one call's keywords on as they came; other orders answer False: the call is derived again)."""
    (args_a, kw_a), (args_b, kw_b) = a, b
    return (len(args_a) == len(args_b) and all(map(_is, args_a, args_b)) and kw_a.keys() == kw_b.keys()
            and all(map(_is, kw_a.values(), kw_b.values())))


def _verified_plan(args: tuple, kwargs: dict) -> tuple | None:
    """``(cuLA's call, the plan)`` the verifier kept for exactly this call, else None; forgets it either way (the
    arguments' tensors are not kept past the call)."""
    last = getattr(_verified, "last", None)
    _verified.last = None
    return last[1:] if last is not None and _same_call(last[0], (args, kwargs)) else None


def _prefill_verdict(call: tuple, fla_arguments: tuple[tuple, dict] | None = None) -> tuple[bool, str | None]:
    """Whether cuLA serves the ``kda_prefill`` call ``call`` on its tensors' device: a call whose signature already
    has a call plan (a GPU backend served it; kept with ``fla_arguments`` for the implementation), else cuLA's
    validator and dispatch asked."""
    signature = call_signature(*call)
    plan = None if signature is None else lookup(signature)
    if plan is not None:
        if fla_arguments is not None:
            _verified.last = (fla_arguments, call, plan)
        return True, None
    try:
        args = validate_kda_prefill(*call)
    except (TypeError, ValueError) as error:
        return False, f"cuLA's checks refuse it: {error}"
    choice = explain(args)
    if choice.runner is None or choice.gpu_fallback:
        return False, choice.summary
    return True, None


_identity_slots: dict[tuple[int, torch.device], torch.Tensor] = {}


def _more_than_one_token(q: torch.Tensor, cu_seqlens: object, N: int) -> bool:
    """Whether a call may hold a sequence of more than one token: a fixed batch with ``T > 1``; packed sequences
    whose CPU boundaries say so, or on a GPU (whose values are not read: that would synchronise) more tokens than
    sequences. A GPU call of ``T <= N`` tokens with ``[N]`` indices is taken as one token or none per sequence, as
    a decode step's batch is (FLA's ``[N]`` semantics for longer sequences write into the neighbours' slots)."""
    if cu_seqlens is None:
        return q.shape[1] > 1
    if q.shape[1] > N:
        return True
    if (cu_seqlens.device.type == "cpu" and is_integer_dtype(cu_seqlens.dtype) and cu_seqlens.ndim == 1
            and cu_seqlens.numel() > 1):
        return bool((cu_seqlens[1:] - cu_seqlens[:-1]).max() > 1)
    return False  # (a cu_seqlens cuLA's checks refuse is declined by them)


def _identity_indices(N: int, device: torch.device) -> torch.Tensor:
    """int32 ``[0, 1, ..., N - 1]`` on ``device`` (sequence ``n`` in slot ``n``), kept per ``(N, device)``."""
    key = (N, device)
    indices = _identity_slots.get(key)
    if indices is None:
        with torch.inference_mode(False):
            indices = torch.arange(N, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return indices  # (filled only when the graph is replayed: not kept)
        if len(_identity_slots) >= 64:
            _identity_slots.clear()
        _identity_slots[key] = indices
    return indices


def _decode_call(verifying: bool, q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                 output_final_state=False, inplace_final_state=True, state_v_first=False, cu_seqlens=None,
                 ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False,
                 use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None,
                 out=None, **kwargs) -> tuple | str:
    """FLA's ``fused_recurrent_kda_fwd`` arguments (after ``verifying``: its signature) as ``(kda_decode's keyword
    arguments, the final state FLA returns, whether the state is the caller's pool)`` (q, k, v, g, beta among the
    keywords), or why cuLA declines. ``verifying``: a stand-in state where the call needs a new one (nothing is
    copied; the third element is then False)."""
    state_v_first = _state_layout(state_v_first, kwargs)
    if isinstance(state_v_first, str):
        return state_v_first
    if kwargs:
        return f"argument(s) cuLA has no equivalent of: {', '.join(sorted(kwargs))}"
    if not isinstance(q, _Tensor) or not isinstance(v, _Tensor):
        return "q and v must be tensors"
    if cu_seqlens is None:
        N = q.shape[0]
    elif isinstance(cu_seqlens, _Tensor):
        N = cu_seqlens.shape[0] - 1
    else:
        return f"cu_seqlens must be a tensor or None, got {type(cu_seqlens).__name__}"
    if ssm_state_indices is not None:
        if not inplace_final_state:
            return ("ssm_state_indices with inplace_final_state=False: FLA writes each token's state to row bos + t "
                    "of a new tensor, a layout cuLA does not produce (it writes states into the pool)")
        if initial_state is None:
            return "ssm_state_indices without initial_state (the pool they index)"
        if getattr(ssm_state_indices, "ndim", None) == 1 and _more_than_one_token(q, cu_seqlens, N):
            return ("[N] ssm_state_indices with more than one token per sequence: FLA writes token t's state to "
                    "ssm_state_indices[n + t]; pass [N, W] indices (a slot per token)")
        state, indices, final_state = initial_state, _int32_each_call(ssm_state_indices), initial_state
        accepted = _int32_each_call(num_accepted_tokens)
    else:
        accepted = None  # (FLA reads the counts only with indices)
        if inplace_final_state:
            if initial_state is None:
                return "inplace_final_state=True without initial_state (FLA writes the final states into it)"
            state = final_state = initial_state
        else:
            HV, K, V = v.shape[2], q.shape[-1], v.shape[-1]
            shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
            if initial_state is not None:
                if not isinstance(initial_state, _Tensor):
                    return f"initial_state must be a tensor or None, got {type(initial_state).__name__}"
                if tuple(initial_state.shape) != shape:
                    dims = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
                    return (f"initial_state must hold one state per sequence, {dims}={list(shape)} as FLA reads it, "
                            f"got {list(initial_state.shape)}")
            if verifying:
                state = torch.empty(shape, dtype=torch.float32, device=q.device)
            elif initial_state is None:
                state = torch.zeros(shape, dtype=torch.float32, device=q.device)
            else:  # cuLA runs on a copy: FLA returns a new fp32 final state (no autograd history) and leaves
                # initial_state as it was
                state = initial_state.detach().to(torch.float32, copy=True)
            final_state = state if output_final_state else None
        indices = _identity_indices(N, q.device)
    if not use_gate_in_kernel:  # (FLA's kernel reads the gate parameters only for the in-kernel gate)
        A_log = dt_bias = lower_bound = None
    call = dict(q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=indices, scale=scale, A_log=A_log,
                dt_bias=dt_bias, lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                allow_neg_eigval=allow_neg_eigval and use_beta_sigmoid_in_kernel, state_v_first=state_v_first,
                cu_seqlens=cu_seqlens, num_accepted_tokens=accepted, out=out)
    return call, final_state, state is initial_state


def _decode_verdict(call: dict, final_state: object = None,
                    fla_arguments: tuple[tuple, dict] | None = None) -> tuple[bool, str | None]:
    """Whether cuLA serves the ``kda_decode`` call ``call`` on its tensors' device: a call whose signature and
    tensors already have a call plan (a GPU backend served it; kept with ``fla_arguments``, where given, and
    ``final_state`` for the implementation), else cuLA's validator and dispatch asked."""
    c = call
    signature = decode_call_signature(
        c["q"], c["k"], c["v"], c["g"], c["beta"], c["state"], c["state_indices"], c["scale"], c["A_log"],
        c["dt_bias"], c["lower_bound"], c["use_qk_l2norm_in_kernel"], c["use_gate_in_kernel"],
        c["use_beta_sigmoid_in_kernel"], c["allow_neg_eigval"], c["state_v_first"], c["cu_seqlens"],
        c["num_accepted_tokens"], c["out"])
    plan = None if signature is None else lookup_guarded(
        signature, c["q"], c["k"], c["v"], c["g"], c["beta"], c["state"], c["state_indices"], c["A_log"],
        c["dt_bias"], c["cu_seqlens"], c["num_accepted_tokens"], c["out"])
    if plan is not None:
        if fla_arguments is not None:
            _verified.last = (fla_arguments, (call, final_state), plan)
        return True, None
    try:
        args = validate_kda_decode(**call)
    except (TypeError, ValueError) as error:
        return False, f"cuLA's checks refuse it: {error}"
    choice = explain_decode(args)
    if choice.runner is None or choice.gpu_fallback:
        return False, choice.summary
    return True, None


class CulaBackend(BaseBackend):
    """cuLA's backend of FLA's ``chunk_kda`` and ``fused_recurrent_kda_fwd`` (see the module's docstring for what
    each serves). Each ``<entry>_verifier`` answers FLA ``(True, None)`` or ``(False, reason)`` without side effects
    on the call's tensors; each ``<entry>`` takes FLA's arguments and returns FLA's values."""

    backend_type = "cula"
    package_name = "cula"
    env_var = ENV_SWITCH
    default_enable = True
    priority = PRIORITY

    def chunk_kda_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        """Whether cuLA serves this ``chunk_kda`` call (FLA's arguments: :func:`_prefill_call`'s signature);
        ``(False, reason)`` when it does not."""
        _verified.last = None
        call = _prefill_call(*args, **kwargs)
        if call.__class__ is str:
            return False, call
        return _prefill_verdict(call, (args, kwargs))

    def chunk_kda(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FLA's ``chunk_kda`` on cuLA: ``(o, final_state)``, ``o`` ``[B, T, HV, V]`` in q's dtype, ``final_state``
        fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``) or None."""
        verified = _verified_plan(args, kwargs)
        if verified is not None:  # (the call its verifier just accepted by its plan)
            c, plan = verified  # (q, k, v, g, beta), then h0, A_log, dt_bias, cu_seqlens, cu_seqlens_cpu
            try:
                return run_prefill_plan(plan, *c[:5], c[6], c[14], c[15], c[16], c[18])
            except LaunchDeclined:  # (a pointer refused before launching: the call as if there were no plan)
                return kda_prefill(*c)
        call = _prefill_call(*args, **kwargs)
        if call.__class__ is str:  # (FLA asks the verifier first: only a direct call gets here)
            raise NotImplementedError(f"cula does not serve this chunk_kda call: {call}")
        return kda_prefill(*call)

    def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs) -> tuple[bool, str | None]:
        """Whether cuLA serves this ``fused_recurrent_kda_fwd`` call (FLA's arguments: :func:`_decode_call`'s
        signature after ``verifying``); ``(False, reason)`` when it does not."""
        _verified.last = None
        call = _decode_call(True, *args, **kwargs)
        if call.__class__ is str:
            return False, call
        arguments, final_state, own_state = call
        # (a call that writes the pool it was given keeps its plan for the implementation; one with a new state
        # tensor was judged on a stand-in here, which the implementation's call must not run on)
        return _decode_verdict(arguments, final_state, (args, kwargs) if own_state else None)

    def fused_recurrent_kda_fwd(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """FLA's KDA decode on cuLA: ``(o, final_state)``, ``o`` ``[B, T, HV, V]`` in q's dtype (``out`` when
        given), ``final_state`` the pool ``initial_state`` updated in place, or a new fp32 one
        (``inplace_final_state=False``, with ``output_final_state``), or None."""
        verified = _verified_plan(args, kwargs)
        if verified is not None:  # (the call its verifier just accepted by its plan)
            (c, final_state), plan = verified
            tensors = (c["q"], c["k"], c["v"], c["g"], c["beta"], c["state"], c["state_indices"], c["A_log"],
                       c["dt_bias"], c["cu_seqlens"], c["num_accepted_tokens"], c["out"])
            try:
                if torch.is_grad_enabled():  # (as below: FLA's decode records no graph)
                    with torch.no_grad():
                        return plan(*tensors), final_state
                return plan(*tensors), final_state
            except LaunchDeclined:  # (refused before launching: the call as if there were no plan)
                pass
        call = _decode_call(False, *args, **kwargs)
        if call.__class__ is str:  # (FLA asks the verifier first: only a direct call gets here)
            raise NotImplementedError(f"cula does not serve this fused_recurrent_kda_fwd call: {call}")
        arguments, final_state, _ = call
        if torch.is_grad_enabled():  # FLA's decode records no graph: neither does cuLA's (it writes in place)
            with torch.no_grad():
                return kda_decode(**arguments), final_state
        return kda_decode(**arguments), final_state
