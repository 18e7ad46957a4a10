"""Call plans: a repeated ``kda_prefill`` call skips validation and dispatch.

A call's *signature* is everything the validator and the dispatch decide from, except ``cu_seqlens``' values: each
tensor argument's class, shape, strides, dtype and device; the flags (``bool`` only), ``scale`` and ``lower_bound``
(``float``/``int`` only); and the value of every ``CULA_*`` knob read so far (:func:`cula_runtime.env.env_snapshot`,
taken after the plan's first run, which may read a knob for the first time). Two calls with
one signature pass the same checks and reach the same backend with the same launch shapes, so the plan a backend
made for the first (``plan(args)``, registered with :func:`cula.dispatch.register_planner`) serves the second: on
the H200 the host time before the first launch was 50-110 us, most of it those decisions, while the GPU waited.

What depends on values is still checked on every call: ``cu_seqlens``' boundaries by ``cula.kda.kda_prefill`` before
it runs a plan (the validator's cached check, :func:`cula_runtime.kda_args.checked_boundaries`, whose host copy the
plan receives), and each pointer's alignment inside the sm90 plan. Plans are
made only for calls whose tensors needed no copy (contiguous) and whose backend offers one (sm90 and cutedsl); a plan
holds no tensor of the call that made it. Calls with non-tensor arguments, tensor subclasses, flags that are not
``bool``, or index tensors on the CPU (a pool-form prefill's or a decode's: the validator checks their values) are
never planned: the validator sees each of them. A planned pool-form call takes its pool, indices and flags as it
comes (``kda_decode`` likewise). ``CULA_CALL_PLANS=0`` turns plans off.

Every op runs the same two steps: ``plan = lookup(signature)`` and, on a hit, the plan; on a miss validation,
dispatch and :func:`first_call`, the one place plans are made and kept. A decode plan is the kernel module's launch
itself (one Python frame between the public call and the compiled kernel, which it calls without Python checks:
TVM-FFI refuses a misaligned pointer before launching, and the plan then sends the call through
``compile_cache.launch``, as the unplanned path does).

``cula.lightning``'s calls are planned by the same rules (:func:`lightning_prefill_call_signature`,
:func:`lightning_decode_call_signature`): the decay is part of the signature as ``g_gamma``'s tensor key, or as the
``layer_idx`` / ``num_layers`` ints; a call with a CPU ``g_gamma`` (the validator checks its values) or CPU index
tensors is never planned. A planned prefill still checks ``cu_seqlens``' values on every call, as ``kda_prefill``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cula_runtime.env import env_snapshot, env_value

from .dispatch import planner_for

__all__ = ["ENV_CALL_PLANS", "call_signature", "clear_call_plans", "decode_call_signature", "first_call", "lookup",
           "remember", "with_current_knobs", "lightning_prefill_call_signature", "lightning_decode_call_signature"]

#: "0" turns call plans off: every call is validated and dispatched (for debugging; read on every call).
ENV_CALL_PLANS = "CULA_CALL_PLANS"

Plan = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

_CAPACITY = 256  # signatures; past it the cache starts over (a serving engine sees a few dozen shapes)
_plans: dict[tuple, Plan] = {}
_Tensor = torch.Tensor
_NUMBERS = (float, int)


class _Unplannable(Exception):
    pass


def _tensor_key(x: object) -> tuple | None:
    if x is None:
        return None
    if x.__class__ is not _Tensor:  # (a subclass, or not a tensor: the validator decides)
        raise _Unplannable
    return x.shape, x.stride(), x.dtype, x.device


def call_signature(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                   use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, A_log,
                   dt_bias, cu_seqlens, state_v_first, cu_seqlens_cpu, state=None, state_indices=None,
                   has_initial_state=None) -> tuple | None:
    """The signature of a ``kda_prefill`` call (its arguments in ``kda_prefill``'s order) as a hashable key, or None
    for a call that is never planned (a pool-form call whose indices are on the CPU, whose slots the validator checks
    on every call, or any with ``CULA_CALL_PLANS=0``). About 5 us."""
    if env_value(ENV_CALL_PLANS, "1") == "0":
        return None
    pooled = not (state is None and state_indices is None and has_initial_state is None)
    if pooled and (state_indices.__class__ is not _Tensor or indices_checked_on_host(state_indices)):
        return None  # (the validator checks CPU slots on every call; a bad pool call is its to refuse)
    flags = (output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, safe_gate, state_v_first)
    for flag in flags:
        if flag.__class__ is not bool:
            return None
    if not ((scale is None or scale.__class__ in _NUMBERS)
            and (lower_bound is None or lower_bound.__class__ in _NUMBERS)):
        return None  # (bool is not a number there; 1 and 1.0 are one key, and one float to the validator)
    try:
        tensors = tuple(map(_tensor_key, (q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens,
                                          cu_seqlens_cpu)))
        pool = tuple(map(_tensor_key, (state, state_indices, has_initial_state))) if pooled else None
    except (_Unplannable, RuntimeError):  # (RuntimeError: a layout without strides)
        return None
    return tensors, pool, flags, scale, lower_bound, env_snapshot()


def decode_call_signature(q, k, v, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          state_v_first, cu_seqlens, num_accepted_tokens, out) -> tuple | None:
    """The signature of a ``kda_decode`` call (its arguments in ``kda_decode``'s order), or None for a call that is
    never planned (``CULA_CALL_PLANS=0``, a flag that is not ``bool``, a ``scale``/``lower_bound`` that is not a
    number, a tensor subclass, or index tensors on the CPU, whose values the validator checks on every call). A
    decode signature never equals a prefill one (its first element is ``"decode"``). One flat tuple, the required
    tensors' keys written out (no call per tensor): about 5 us here for the benchmark's call."""
    if not (q.__class__ is _Tensor and k.__class__ is _Tensor and v.__class__ is _Tensor and g.__class__ is _Tensor
            and beta.__class__ is _Tensor and state.__class__ is _Tensor and state_indices.__class__ is _Tensor
            and use_qk_l2norm_in_kernel.__class__ is bool and use_gate_in_kernel.__class__ is bool
            and use_beta_sigmoid_in_kernel.__class__ is bool and allow_neg_eigval.__class__ is bool
            and state_v_first.__class__ is bool and (scale is None or scale.__class__ in _NUMBERS)
            and (lower_bound is None or lower_bound.__class__ in _NUMBERS)):
        return None
    if env_value(ENV_CALL_PLANS, "1") == "0" or indices_checked_on_host(state_indices):
        return None
    try:
        return ("decode",
                q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
                v.shape, v.stride(), v.dtype, v.device, g.shape, g.stride(), g.dtype, g.device,
                beta.shape, beta.stride(), beta.dtype, beta.device, state.shape, state.stride(), state.dtype,
                state.device, state_indices.shape, state_indices.stride(), state_indices.dtype, state_indices.device,
                None if A_log is None else _tensor_key(A_log), None if dt_bias is None else _tensor_key(dt_bias),
                None if cu_seqlens is None else _tensor_key(cu_seqlens),
                None if num_accepted_tokens is None else _tensor_key(num_accepted_tokens),
                None if out is None else _tensor_key(out),
                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                state_v_first, scale, lower_bound, env_snapshot())
    except (_Unplannable, RuntimeError):  # (RuntimeError: a layout without strides)
        return None


def _decay_key(g_gamma: object, layer_idx: object, num_layers: object) -> tuple:
    """The decay's part of a Lightning signature; ``_Unplannable`` for one the validator must see (a CPU
    ``g_gamma``, whose values it checks; ``layer_idx`` / ``num_layers`` that are not both ints)."""
    if g_gamma is not None:
        if g_gamma.__class__ is not _Tensor or g_gamma.device.type == "cpu":
            raise _Unplannable
        return _tensor_key(g_gamma), None, None
    if layer_idx.__class__ is not int or num_layers.__class__ is not int:
        raise _Unplannable
    return None, layer_idx, num_layers


def lightning_prefill_call_signature(q, k, v, g_gamma, layer_idx, num_layers, scale, initial_state,
                                     output_final_state, cu_seqlens, state_v_first, state=None, state_indices=None,
                                     has_initial_state=None) -> tuple | None:
    """The signature of a ``lightning_prefill`` call (its arguments in ``lightning_prefill``'s order), or None for
    one that is never planned (``CULA_CALL_PLANS=0``, a flag that is not ``bool``, a ``scale`` that is not a number,
    a tensor subclass, a CPU ``g_gamma``, a pool-form call with CPU indices). Its first element is
    ``"lightning_prefill"``: it never equals another op's."""
    if env_value(ENV_CALL_PLANS, "1") == "0":
        return None
    pooled = not (state is None and state_indices is None and has_initial_state is None)
    if pooled and (state_indices.__class__ is not _Tensor or indices_checked_on_host(state_indices)):
        return None
    if output_final_state.__class__ is not bool or state_v_first.__class__ is not bool:
        return None
    if not (scale is None or scale.__class__ in _NUMBERS):
        return None
    try:
        decay = _decay_key(g_gamma, layer_idx, num_layers)
        tensors = tuple(map(_tensor_key, (q, k, v, initial_state, cu_seqlens)))
        pool = tuple(map(_tensor_key, (state, state_indices, has_initial_state))) if pooled else None
    except (_Unplannable, RuntimeError):
        return None
    return "lightning_prefill", tensors, decay, pool, output_final_state, state_v_first, scale, env_snapshot()


def lightning_decode_call_signature(q, k, v, g_gamma, layer_idx, num_layers, scale, state, state_indices,
                                    state_v_first, cu_seqlens, out) -> tuple | None:
    """The signature of a ``lightning_decode`` call (its arguments in ``lightning_decode``'s order), or None for
    one that is never planned (as :func:`lightning_prefill_call_signature`; CPU ``state_indices`` never are). One
    flat tuple, as :func:`decode_call_signature`'s."""
    if not (q.__class__ is _Tensor and k.__class__ is _Tensor and v.__class__ is _Tensor
            and state.__class__ is _Tensor and state_indices.__class__ is _Tensor
            and state_v_first.__class__ is bool and (scale is None or scale.__class__ in _NUMBERS)):
        return None
    if env_value(ENV_CALL_PLANS, "1") == "0" or indices_checked_on_host(state_indices):
        return None
    try:
        return ("lightning_decode",
                q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device,
                v.shape, v.stride(), v.dtype, v.device, state.shape, state.stride(), state.dtype, state.device,
                state_indices.shape, state_indices.stride(), state_indices.dtype, state_indices.device,
                None if cu_seqlens is None else _tensor_key(cu_seqlens), None if out is None else _tensor_key(out),
                _decay_key(g_gamma, layer_idx, num_layers), state_v_first, scale, env_snapshot())
    except (_Unplannable, RuntimeError):
        return None


def indices_checked_on_host(state_indices: torch.Tensor) -> bool:
    """Whether the validator reads a decode call's index values (CPU tensors: it checks them on every call, so such
    a call is never planned; on a GPU it reads none)."""
    return state_indices.device.type == "cpu"


def with_current_knobs(signature: tuple) -> tuple:
    """``signature`` with the knobs' values as they are now (after a call that may have read new ones)."""
    return *signature[:-1], env_snapshot()


def lookup(signature: tuple | None) -> Plan | None:
    """The plan made for this signature, or None (also for a None signature: a call never planned)."""
    return _plans.get(signature)


def remember(signature: tuple, plan: Plan) -> None:
    """Keep ``plan`` for every later call with this signature."""
    if len(_plans) >= _CAPACITY:
        _plans.clear()
    _plans[signature] = plan


def first_call(signature: tuple | None, args: object, runner: Callable, as_is: bool, plan_args: tuple,
               plan_kwargs: dict | None = None) -> object:
    """A call no plan served, after validation (``args``) and dispatch (``runner``): the one place where plans are
    made, for every op. When the call has a signature and its tensors were taken as passed (``as_is``) and
    ``runner``'s backend makes plans (:func:`cula.dispatch.planner_for`) and makes one for ``args``, that plan runs
    the call (``plan(*plan_args, **plan_kwargs)``) and is kept under the signature with the knobs as they are after
    this first run (which may read a knob for the first time); otherwise ``runner(args)`` runs it. Returns what
    either returned."""
    if signature is not None and as_is:
        planner = planner_for(runner)
        plan = None if planner is None else planner(args)
        if plan is not None:
            result = plan(*plan_args, **(plan_kwargs or {}))
            remember(with_current_knobs(signature), plan)
            return result
    return runner(args)


def clear_call_plans() -> None:
    """Forget every plan (the next call of each signature is validated and dispatched again)."""
    _plans.clear()
