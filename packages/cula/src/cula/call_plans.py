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
plan receives), and each pointer's alignment inside the sm90 plan. A call that writes a tensor in place (a pool,
``out``) holds grad mode and inference mode in its signature too, and the pool's ``requires_grad`` and
``is_inference()`` (the decode's guards hold them): a pool the validator would refuse to write is never served by a
plan made for a writable one. Where arguments lie in memory relative to each
other (a pool or ``out`` sharing memory with another argument, refused by the validators) is checked on the call
that makes a plan, not on the calls it serves. Plans are
made only for calls whose tensors needed no copy (contiguous) and whose backend offers one (sm90 and cutedsl); a plan
holds no tensor of the call that made it. Calls with non-tensor arguments, tensor subclasses (``nn.Parameter`` itself
aside: a model's ``A_log`` and ``dt_bias`` are planned), flags that are not
``bool``, or index tensors on the CPU (a pool-form prefill's or a decode's: the validator checks their values) are
never planned: the validator sees each of them. A planned pool-form call takes its pool, indices and flags as it
comes (``kda_decode`` likewise). ``CULA_CALL_PLANS=0`` turns plans off.

Every op runs the same two steps: ``plan = lookup(signature)`` and, on a hit, the plan; on a miss validation,
dispatch and :func:`first_call`, the one place plans are made and kept. A decode plan is the kernel module's launch
itself (one Python frame between the public call and the compiled kernel, which it calls without Python checks:
TVM-FFI refuses a misaligned pointer before launching; the KDA decode's plan then raises
:class:`~cula_runtime.cute.compile_cache.LaunchDeclined` and the call is validated and dispatched as if there were
no plan, e.g. to the reference for a misaligned pool, which the CuTeDSL backend declines).

``kda_decode``'s signature (:func:`decode_call_signature`) holds no tensor metadata but ``q``'s shape: its plans are
kept with *guards* of the tensors of the call that made them (:func:`tensor_guards`, checked by
:func:`lookup_guarded`), torch's native tensor guards (the C++ check behind ``torch.compile``'s guards: each tensor's
exact class, dispatch keys, dtype, device, shape, strides, ``requires_grad``) where they pass a probe, else the same
comparison in Python. Reading a tensor's shape, strides, dtype and device in Python and hashing them cost about
0.45 us per tensor here; the native check about 0.1 us. A decode with CPU index tensors (checked on every call by
the validator) or a tensor subclass, or one tensor at two places, is never planned; the guards hold the indices'
device, so a later CPU-index call never passes a plan's guards.

``cula.lightning``'s calls are planned by the same rules (:func:`lightning_prefill_call_signature`; the decode's,
:func:`lightning_decode_call_signature`, with guards as ``kda_decode``'s): the decay is part of the prefill's
signature as ``g_gamma``'s tensor key, or as the ``layer_idx`` / ``num_layers`` ints; a call with a CPU ``g_gamma``
(the validator checks its values) or CPU index tensors is never planned. A planned prefill still checks
``cu_seqlens``' values on every call, as ``kda_prefill``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from cula_runtime.cute.compile_cache import LaunchDeclined
from cula_runtime.env import env_snapshot, env_value

from .dispatch import planner_for

__all__ = ["ENV_CALL_PLANS", "LaunchDeclined", "call_signature", "clear_call_plans", "decode_call_signature",
           "first_call", "lookup", "lookup_guarded", "remember", "tensor_guards", "with_current_knobs",
           "lightning_prefill_call_signature", "lightning_decode_call_signature", "lookup_guarded_lightning",
           "has_guarded_plans"]

#: "0" turns call plans off: every call is validated and dispatched (for debugging; read on every call).
ENV_CALL_PLANS = "CULA_CALL_PLANS"

Plan = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]

_CAPACITY = 256  # signatures; past it the cache starts over (a serving engine sees a few dozen shapes)
_plans: dict[tuple, Plan] = {}
# decode signatures (no tensor metadata) -> ((guards, plan), ...), the newest first, at most _GUARDED_PER_SIGNATURE
_guarded_plans: dict[tuple, tuple[tuple[object, Plan], ...]] = {}
_GUARDED_PER_SIGNATURE = 4
_Tensor = torch.Tensor
# the classes a plan takes as they are: plain tensors and ``nn.Parameter`` (a model's ``A_log`` / ``dt_bias``), which
# overrides no torch function, so every kernel and check sees it as a plain tensor; any other subclass (fake,
# functional, distributed tensors, a Parameter subclass) goes through the validator on every call
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NUMBERS = (float, int)


class _Unplannable(Exception):
    pass


_grad_enabled = torch.is_grad_enabled
_inference_mode_enabled = torch.is_inference_mode_enabled


def _write_modes() -> tuple[bool, bool]:
    """Grad mode and inference mode now: part of every signature of a call that writes a tensor in place (a pool,
    ``out``), since whether torch lets the call write it (:func:`cula_runtime.kda_args.check_writable`) depends on
    them as on the tensor's own ``requires_grad`` and ``is_inference()``."""
    return _grad_enabled(), _inference_mode_enabled()


def _pool_key(state: object, state_indices: object, has_initial_state: object) -> tuple:
    """A pool call's part of a prefill signature: the three tensors' keys, the pool's ``requires_grad`` and
    ``is_inference()`` and the modes (:func:`_write_modes`), so that a pool the validator would refuse to write is
    never served by a plan made for a writable one."""
    keys = tuple(map(_tensor_key, (state, state_indices, has_initial_state)))
    return keys, state.requires_grad, state.is_inference(), _write_modes()


def _tensor_key(x: object) -> tuple | None:
    if x is None:
        return None
    if x.__class__ not in _PLAIN:  # (a subclass, or not a tensor: the validator decides)
        raise _Unplannable
    return x.shape, x.stride(), x.dtype, x.device


# ------------------------------------------------------------------------------------------------- tensor guards

#: what a plan's guards check where a tensor is absent, one per place (which ones are absent is in the signature;
#: the native guards refuse one object at two places)
_ABSENT = tuple(torch.empty(()) for _ in range(16))


def _guard_key(x: object) -> tuple:
    return x.__class__, x.shape, x.stride(), x.dtype, x.device, x.requires_grad, x.is_inference()


class _PythonGuards:
    """Tensor guards in Python: each tensor's exact class, shape, strides, dtype, device, ``requires_grad`` and
    ``is_inference()`` compared with the recorded ones, and no tensor at two places (where torch's native guards are
    missing or do not answer as expected)."""

    __slots__ = ("_recorded",)

    def __init__(self, tensors: tuple) -> None:
        self._recorded = tuple(map(_guard_key, tensors))

    def check(self, *tensors: object) -> bool:
        try:
            return (tuple(map(_guard_key, tensors)) == self._recorded
                    and len(set(map(id, tensors))) == len(tensors))  # (one tensor at two places: as the native)
        except (AttributeError, RuntimeError, TypeError):  # (not a tensor; a layout without strides)
            return False


class _ProbeSubclass(torch.Tensor):
    pass


def _native(tensors: tuple) -> object:
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


@functools.cache
def _guard_maker() -> Callable[[tuple], object]:
    """How guards are made: torch's native tensor guards (``torch._C._dynamo.guards.TensorGuards``, the C++ check
    behind ``torch.compile``'s guards: about 0.1 us per tensor here, against 0.35 us to read a tensor's shape,
    strides, dtype and device in Python and more to hash them) when they import and answer a probe as this module
    needs (equal metadata passes; another shape, strides, dtype, device, class or ``requires_grad`` fails); else
    :class:`_PythonGuards`, which checks the same in Python. The native guards also compare each tensor's dispatch
    keys under the thread's dispatch state (for instance ``torch.inference_mode``): stricter, never looser."""
    try:
        probe, absent = torch.zeros(2, 3), _ABSENT[1]
        guards = _native((probe, absent))
        changed = (torch.zeros(3, 2), torch.zeros(2, 4)[:, :3], torch.zeros(2, 3, dtype=torch.float64),
                   torch.zeros(2, 3, device="meta"), torch.zeros(2, 3).as_subclass(_ProbeSubclass),
                   torch.zeros(2, 3, requires_grad=True))
        if guards.check(torch.zeros(2, 3), absent) and not any(guards.check(x, absent) for x in changed) \
                and not guards.check(probe, None):
            return _native
    except (ImportError, AttributeError, RuntimeError, TypeError, ValueError):
        pass
    return _PythonGuards


def tensor_guards(tensors: tuple) -> object | None:
    """Guards of these tensors (None where absent: :data:`_ABSENT` stands in): ``guards.check(*others)`` is True
    exactly when each of ``others`` has the class, shape, strides, dtype, device (and ``requires_grad``) of the
    tensor at its place and, with the native guards, no object is at two places. None (never planned) when one of
    them is neither a plain tensor nor exactly an ``nn.Parameter`` (another subclass) or one tensor is at two places
    (the native guards would refuse every such call)."""
    tensors = tuple(_ABSENT[i] if t is None else t for i, t in enumerate(tensors))
    if any(t.__class__ not in _PLAIN for t in tensors) or len(set(map(id, tensors))) != len(tensors):
        return None
    return _guard_maker()(tensors)


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
        pool = _pool_key(state, state_indices, has_initial_state) if pooled else None
    except (_Unplannable, RuntimeError):  # (RuntimeError: a layout without strides)
        return None
    return tensors, pool, flags, scale, lower_bound, env_snapshot()


def decode_call_signature(q, k, v, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound,
                          use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                          state_v_first, cu_seqlens, num_accepted_tokens, out) -> tuple | None:
    """The signature of a ``kda_decode`` call (its arguments in ``kda_decode``'s order) without its tensors'
    metadata, or None for a call that is never planned (a flag that is not ``bool``, a ``scale``/``lower_bound``
    that is not a number, a ``q`` that is not exactly a ``torch.Tensor``): ``("decode", q.shape, which optional
    tensors are None, the flags, scale, lower_bound, the knob snapshot)``. The tensors themselves are checked by the
    plan's guards (:func:`lookup_guarded`: every tensor's class, shape, strides, dtype, device), which is what the
    rest of a full signature would have held; ``CULA_CALL_PLANS`` and the indices' device are read when a plan is
    made (:func:`first_call`), since a plan's guards hold the device of the indices it was made for and the snapshot
    holds ``CULA_CALL_PLANS``' value. Its first element is ``"decode"``: it never equals another op's."""
    if not (q.__class__ is _Tensor and use_qk_l2norm_in_kernel.__class__ is bool
            and use_gate_in_kernel.__class__ is bool and use_beta_sigmoid_in_kernel.__class__ is bool
            and allow_neg_eigval.__class__ is bool and state_v_first.__class__ is bool
            and (scale is None or scale.__class__ in _NUMBERS)
            and (lower_bound is None or lower_bound.__class__ in _NUMBERS)):
        return None
    return ("decode", q.shape, A_log is None, dt_bias is None, cu_seqlens is None, num_accepted_tokens is None,
            out is None, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            state_v_first, scale, lower_bound, _write_modes(), env_snapshot())


def lookup_guarded(signature: tuple | None, q, k, v, g, beta, state, state_indices, A_log, dt_bias, cu_seqlens,
                   num_accepted_tokens, out) -> Plan | None:
    """The plan kept for this signature (:func:`decode_call_signature`) whose guards accept these tensors (in the
    plan's argument order; an absent one is None, and which are absent is part of the signature), or None."""
    entries = _guarded_plans.get(signature)
    if entries is not None:
        absent = _ABSENT
        for guards, plan in entries:
            if guards.check(q, k, v, g, beta, state, state_indices, absent[7] if A_log is None else A_log,
                            absent[8] if dt_bias is None else dt_bias,
                            absent[9] if cu_seqlens is None else cu_seqlens,
                            absent[10] if num_accepted_tokens is None else num_accepted_tokens,
                            absent[11] if out is None else out):
                return plan
    return None


def _decay_key(g_gamma: object, layer_idx: object, num_layers: object) -> tuple:
    """The decay's part of a Lightning signature; ``_Unplannable`` for one the validator must see (a CPU
    ``g_gamma``, whose values it checks; ``layer_idx`` / ``num_layers`` that are not both ints)."""
    if g_gamma is not None:
        if g_gamma.__class__ not in _PLAIN or g_gamma.device.type == "cpu":
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
        pool = _pool_key(state, state_indices, has_initial_state) if pooled else None
    except (_Unplannable, RuntimeError):
        return None
    return "lightning_prefill", tensors, decay, pool, output_final_state, state_v_first, scale, env_snapshot()


def lightning_decode_call_signature(q, k, v, g_gamma, layer_idx, num_layers, scale, state, state_indices,
                                    state_v_first, cu_seqlens, out) -> tuple | None:
    """The signature of a ``lightning_decode`` call (its arguments in ``lightning_decode``'s order) without its
    tensors' metadata, as :func:`decode_call_signature`'s: ``("lightning_decode", q.shape, which optional tensors
    are None, the decay's form, state_v_first, scale, the knob snapshot)``; the tensors are checked by the plan's
    guards (:func:`lookup_guarded_lightning`), ``CULA_CALL_PLANS`` and the indices' device when a plan is made. None
    for a call that is never planned: ``q`` not exactly a ``torch.Tensor``, a flag that is not ``bool``, a ``scale``
    that is not a number, ``layer_idx`` / ``num_layers`` not both ints (or given with ``g_gamma``: the validator's
    error), a CPU ``g_gamma`` (whose values the validator checks on every call)."""
    if not (q.__class__ is _Tensor and state_v_first.__class__ is bool
            and (scale is None or scale.__class__ in _NUMBERS)):
        return None
    if g_gamma is None:
        if layer_idx.__class__ is not int or num_layers.__class__ is not int:
            return None
    elif layer_idx is not None or num_layers is not None or g_gamma.__class__ not in _PLAIN \
            or g_gamma.device.type == "cpu":  # (a CPU g_gamma's values are checked by the validator on every call)
        return None
    return ("lightning_decode", q.shape, g_gamma is None, layer_idx, num_layers, cu_seqlens is None, out is None,
            state_v_first, scale, _write_modes(), env_snapshot())


def has_guarded_plans(signature: tuple) -> bool:
    """Whether plans with guards are kept for this signature (before the guards' tensors are worked out)."""
    return signature in _guarded_plans


def lookup_guarded_lightning(signature: tuple | None, q, k, v, g_gamma, state, state_indices, cu_seqlens,
                             out) -> Plan | None:
    """The plan kept for this ``lightning_decode`` signature (:func:`lightning_decode_call_signature`) whose guards
    accept these tensors (the plan's argument order; ``g_gamma`` the decay tensor the plan gets: the call's, or its
    layer's kept one), or None."""
    entries = _guarded_plans.get(signature)
    if entries is not None:
        absent = _ABSENT
        for guards, plan in entries:
            if guards.check(q, k, v, g_gamma, state, state_indices, absent[6] if cu_seqlens is None else cu_seqlens,
                            absent[7] if out is None else out):
                return plan
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


def remember(signature: tuple, plan: Plan, guards: object | None = None) -> None:
    """Keep ``plan`` for every later call with this signature (and, with ``guards``, whose tensors they accept:
    :func:`lookup_guarded`)."""
    if len(_plans) + len(_guarded_plans) >= _CAPACITY:
        _plans.clear()
        _guarded_plans.clear()
    if guards is None:
        _plans[signature] = plan
    else:
        _guarded_plans[signature] = ((guards, plan), *_guarded_plans.get(signature, ())[:_GUARDED_PER_SIGNATURE - 1])


def first_call(signature: tuple | None, args: object, runner: Callable, as_is: bool, plan_args: tuple,
               plan_kwargs: dict | None = None, guarded: bool = False) -> object:
    """A call no plan served, after validation (``args``) and dispatch (``runner``): the one place where plans are
    made, for every op. When the call has a signature and its tensors were taken as passed (``as_is``),
    ``CULA_CALL_PLANS`` is not ``0``, and ``runner``'s backend makes plans (:func:`cula.dispatch.planner_for`) and
    makes one for ``args``, that plan runs the call (``plan(*plan_args, **plan_kwargs)``) and is kept under the
    signature with the knobs as they are after this first run (which may read a knob for the first time); with
    ``guarded`` (a signature without tensor metadata), together with the guards of ``plan_args``' tensors
    (:func:`tensor_guards`; a tensor subclass among them: no plan). A plan that declines its first call
    (:class:`LaunchDeclined`: refused before launching, e.g. a misaligned pointer) is not kept and ``runner(args)``
    runs the call; otherwise ``runner(args)`` runs it. Returns what either returned."""
    if signature is not None and as_is and env_value(ENV_CALL_PLANS, "1") != "0":
        planner = planner_for(runner)
        plan = None if planner is None else planner(args)
        guards = tensor_guards(plan_args) if plan is not None and guarded else None
        if plan is not None and (guards is not None or not guarded):
            try:
                result = plan(*plan_args, **(plan_kwargs or {}))
            except LaunchDeclined:  # (kept by the next call it serves)
                return runner(args)
            remember(with_current_knobs(signature), plan, guards)
            return result
    return runner(args)


def clear_call_plans() -> None:
    """Forget every plan (the next call of each signature is validated and dispatched again)."""
    _plans.clear()
    _guarded_plans.clear()
