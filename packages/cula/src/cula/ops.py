"""cuLA's calls as torch custom ops: ``torch.ops.cula.kda_prefill``, ``kda_prefill_pool``, ``kda_decode`` and
``kda_decode_out``, and the ``lightning_*`` ones (below), registered once when ``cula`` is imported (no GPU code,
CuTeDSL or native extension is imported).

Why: ``torch.compile(fullgraph=True)`` cannot trace into the GPU backends (raw pointers handed to a native
extension or a CuTeDSL kernel), and a serving engine wraps every kernel in an op that the compiler keeps as one node
and CUDA graphs capture. Each op has a fake (meta) implementation that gives its outputs' exact shapes, dtypes and
devices without running anything, so the compiler traces the model around it. The real implementation calls the
Python API (:func:`cula.kda.kda_prefill`, :func:`cula.kda.kda_decode`): validation, dispatch and call plans are the
same for both doors, and a model may call either.

The ops (arguments in the order and with the defaults of the Python API; every argument may be passed by name):

- ``kda_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, ...,
  cu_seqlens_cpu=None) -> (o, final_state)``: :func:`cula.kda.kda_prefill`'s plain form. A custom op cannot return
  ``None``, so with ``output_final_state=False`` ``final_state`` is an **empty fp32 tensor** (shape ``[0]``, on q's
  device): test ``final_state.numel() == 0``. With it, ``final_state`` is fp32 ``[N, HV, K, V]`` (``[N, HV, V, K]``
  with ``state_v_first``), ``N`` = ``len(cu_seqlens) - 1`` or ``B``.
- ``kda_prefill_pool(q, k, v, g, beta, state, state_indices, has_initial_state=None, scale=None, ...) -> o``: the pool
  form (``state=`` in the Python API): the final states are written into ``state`` in place (declared mutated).
- ``kda_decode(q, k, v, g, beta, state, state_indices, scale=None, ...) -> o``: :func:`cula.kda.kda_decode`, the pool
  ``state`` mutated in place; ``o`` is a new tensor.
- ``kda_decode_out(q, k, v, g, beta, state, state_indices, out, scale=None, ...) -> ()``: the same writing ``o`` into
  ``out`` (both ``state`` and ``out`` declared mutated, nothing returned). An op may not return one of its inputs, so
  the ``out=`` form of the Python API is an op of its own, as the out-forms of a serving engine's ops are.

The Lightning Attention ops (:mod:`cula.lightning`), in the same forms, the decay as ``g_gamma`` or
``layer_idx``/``num_layers``:

- ``lightning_prefill(q, k, v, g_gamma=None, layer_idx=None, num_layers=None, scale=None, initial_state=None,
  output_final_state=False, cu_seqlens=None, state_v_first=False) -> (o, final_state)`` (``final_state``: an empty
  fp32 ``[0]`` tensor without ``output_final_state``, as ``kda_prefill``'s);
- ``lightning_prefill_pool(q, k, v, state, state_indices, has_initial_state=None, g_gamma=None, ...) -> o``;
- ``lightning_decode(q, k, v, state, state_indices, g_gamma=None, ..., state_v_first=False, cu_seqlens=None) -> o``;
- ``lightning_decode_out(q, k, v, state, state_indices, out, g_gamma=None, ...) -> ()``.

``o`` is always ``[B, T, HV, V]`` (Lightning: ``[B, T, H, V]``) in q's dtype on q's device, contiguous. Bad
arguments raise the Python API's ``TypeError``/``ValueError`` naming the argument, with one exception: torch parses
each call against the op's schema before any of cuLA runs, so a value the schema cannot take (a list or an array
for a ``Tensor``, a string for a ``float``, a missing required argument) is torch's ``RuntimeError`` naming the
argument, and a value the schema converts reaches cuLA converted (``True`` for ``scale`` as 1.0, ``1`` for a flag as
``True``). The fake implementations check that every tensor is on q's device (a meta tensor among real ones would
otherwise reach them: ``ValueError`` naming it, as the Python API).

No op registers a backward (cuLA serves inference): called eagerly, gradients flow through an op exactly where they
flow through the Python API (the CPU reference is torch code, whose ops record the graph under torch's autograd
fallback; the GPU kernels record nothing), and torch warns on a backward through an op that it has no autograd
kernel. Under ``torch.compile`` an op is one opaque node: no gradient flows through it on any device, and a pool
that requires grad is not refused; compile cuLA's calls under ``torch.no_grad()`` or ``torch.inference_mode()``.

Registered with ``torch.library.Library`` (``define``; ``impl`` at ``CompositeExplicitAutograd``, i.e. every device)
and ``torch.library.register_fake``, not with ``torch.library.custom_op``: the latter's autograd wrapper runs on every
call outside inference mode and cost about 30 us more per eager call here (50 us against 20 us for an op of these
19 arguments doing nothing, a 2-core CPU, torch 2.13), more than the goal of 10 us over a plain call; so did a Python
guard at the Autograd key refusing inputs that require grad (+13 us).
"""

from __future__ import annotations

import torch

from cula_runtime.kda_args import check_cu_seqlens_shape, check_host_copy_device, check_kda_inputs
from cula_runtime.lightning_args import check_lightning_inputs

from .kda import kda_decode_ordered, kda_prefill
from .lightning import lightning_decode, lightning_prefill

__all__ = ["NAMESPACE", "OPS", "KDA_OPS", "LIGHTNING_OPS"]

NAMESPACE = "cula"
KDA_OPS = ("kda_prefill", "kda_prefill_pool", "kda_decode", "kda_decode_out")
LIGHTNING_OPS = ("lightning_prefill", "lightning_prefill_pool", "lightning_decode", "lightning_decode_out")
#: the ops this module defines, in ``torch.ops.cula``
OPS = KDA_OPS + LIGHTNING_OPS

# The arguments every op shares after the inputs, in the Python API's names and defaults.
_GATE_FLAGS = ("bool use_qk_l2norm_in_kernel=False, bool use_gate_in_kernel=False, "
               "bool use_beta_sigmoid_in_kernel=False, bool allow_neg_eigval=False")
_PREFILL_TAIL = (f"{_GATE_FLAGS}, bool safe_gate=False, float? lower_bound=None, Tensor? A_log=None, "
                 "Tensor? dt_bias=None, Tensor? cu_seqlens=None, bool state_v_first=False, Tensor? cu_seqlens_cpu=None")
_DECODE_TAIL = (f"float? scale=None, Tensor? A_log=None, Tensor? dt_bias=None, float? lower_bound=None, {_GATE_FLAGS}, "
                "bool state_v_first=False, Tensor? cu_seqlens=None, Tensor? num_accepted_tokens=None")
_INPUTS = "Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta"

SCHEMAS = {
    "kda_prefill": f"({_INPUTS}, float? scale=None, Tensor? initial_state=None, bool output_final_state=False, "
                   f"{_PREFILL_TAIL}) -> (Tensor, Tensor)",
    "kda_prefill_pool": f"({_INPUTS}, Tensor(a!) state, Tensor state_indices, Tensor? has_initial_state=None, "
                        f"float? scale=None, {_PREFILL_TAIL}) -> Tensor",
    "kda_decode": f"({_INPUTS}, Tensor(a!) state, Tensor state_indices, {_DECODE_TAIL}) -> Tensor",
    "kda_decode_out": f"({_INPUTS}, Tensor(a!) state, Tensor state_indices, Tensor(b!) out, {_DECODE_TAIL}) -> ()",
}

_LA_INPUTS = "Tensor q, Tensor k, Tensor v"
_LA_DECAY = "Tensor? g_gamma=None, int? layer_idx=None, int? num_layers=None, float? scale=None"
_LA_POOL = "Tensor(a!) state, Tensor state_indices"
SCHEMAS.update({
    "lightning_prefill": f"({_LA_INPUTS}, {_LA_DECAY}, Tensor? initial_state=None, bool output_final_state=False, "
                         "Tensor? cu_seqlens=None, bool state_v_first=False) -> (Tensor, Tensor)",
    "lightning_prefill_pool": f"({_LA_INPUTS}, {_LA_POOL}, Tensor? has_initial_state=None, {_LA_DECAY}, "
                              "Tensor? cu_seqlens=None, bool state_v_first=False) -> Tensor",
    "lightning_decode": f"({_LA_INPUTS}, {_LA_POOL}, {_LA_DECAY}, bool state_v_first=False, "
                        "Tensor? cu_seqlens=None) -> Tensor",
    "lightning_decode_out": f"({_LA_INPUTS}, {_LA_POOL}, Tensor(b!) out, {_LA_DECAY}, bool state_v_first=False, "
                            "Tensor? cu_seqlens=None) -> ()",
})


def _no_final_state(q: torch.Tensor) -> torch.Tensor:
    """What ``kda_prefill`` returns for the final state with ``output_final_state=False``: fp32 ``[0]``."""
    return torch.empty(0, dtype=torch.float32, device=q.device)


def _output_like(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """An empty ``o``: ``[B, T, HV, V]`` in q's dtype on q's device (the fake implementations' output)."""
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2], v.shape[3]))


# ---- real implementations: the Python API -------------------------------------------------------------------------

def _kda_prefill(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                 allow_neg_eigval=False, safe_gate=False, lower_bound=None, A_log=None, dt_bias=None, cu_seqlens=None,
                 state_v_first=False, cu_seqlens_cpu=None):
    o, final_state = kda_prefill(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                                 use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                 lower_bound, A_log, dt_bias, cu_seqlens, state_v_first, cu_seqlens_cpu)
    return o, _no_final_state(q) if final_state is None else final_state


def _kda_prefill_pool(q, k, v, g, beta, state, state_indices, has_initial_state=None, scale=None,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, safe_gate=False, lower_bound=None, A_log=None, dt_bias=None,
                      cu_seqlens=None, state_v_first=False, cu_seqlens_cpu=None):
    o, _ = kda_prefill(q, k, v, g, beta, scale, None, False, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                       use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias,
                       cu_seqlens, state_v_first, cu_seqlens_cpu, state=state, state_indices=state_indices,
                       has_initial_state=has_initial_state)
    return o


def _kda_decode(q, k, v, g, beta, state, state_indices, scale=None, A_log=None, dt_bias=None, lower_bound=None,
                use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, num_accepted_tokens=None):
    return kda_decode_ordered(q, k, v, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound,
                              use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                              state_v_first, cu_seqlens, num_accepted_tokens, None)


def _kda_decode_out(q, k, v, g, beta, state, state_indices, out, scale=None, A_log=None, dt_bias=None,
                    lower_bound=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                    use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                    num_accepted_tokens=None):
    kda_decode_ordered(q, k, v, g, beta, state, state_indices, scale, A_log, dt_bias, lower_bound,
                       use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                       state_v_first, cu_seqlens, num_accepted_tokens, out)


def _lightning_prefill(q, k, v, g_gamma=None, layer_idx=None, num_layers=None, scale=None, initial_state=None,
                       output_final_state=False, cu_seqlens=None, state_v_first=False):
    o, final_state = lightning_prefill(q, k, v, g_gamma, layer_idx=layer_idx, num_layers=num_layers, scale=scale,
                                       initial_state=initial_state, output_final_state=output_final_state,
                                       cu_seqlens=cu_seqlens, state_v_first=state_v_first)
    return o, _no_final_state(q) if final_state is None else final_state


def _lightning_prefill_pool(q, k, v, state, state_indices, has_initial_state=None, g_gamma=None, layer_idx=None,
                            num_layers=None, scale=None, cu_seqlens=None, state_v_first=False):
    o, _ = lightning_prefill(q, k, v, g_gamma, layer_idx=layer_idx, num_layers=num_layers, scale=scale,
                             cu_seqlens=cu_seqlens, state_v_first=state_v_first, state=state,
                             state_indices=state_indices, has_initial_state=has_initial_state)
    return o


def _lightning_decode(q, k, v, state, state_indices, g_gamma=None, layer_idx=None, num_layers=None, scale=None,
                      state_v_first=False, cu_seqlens=None):
    return lightning_decode(q, k, v, g_gamma, layer_idx=layer_idx, num_layers=num_layers, scale=scale, state=state,
                            state_indices=state_indices, state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def _lightning_decode_out(q, k, v, state, state_indices, out, g_gamma=None, layer_idx=None, num_layers=None,
                          scale=None, state_v_first=False, cu_seqlens=None):
    lightning_decode(q, k, v, g_gamma, layer_idx=layer_idx, num_layers=num_layers, scale=scale, state=state,
                     state_indices=state_indices, state_v_first=state_v_first, cu_seqlens=cu_seqlens, out=out)


# ---- fake implementations: shapes, dtypes and devices only ------------------------------------------------------

def _kda_prefill_fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                      allow_neg_eigval=False, safe_gate=False, lower_bound=None, A_log=None, dt_bias=None,
                      cu_seqlens=None, state_v_first=False, cu_seqlens_cpu=None):
    check_kda_inputs(q, k, v, g, beta)
    return _prefill_outputs_like(q, v, output_final_state, cu_seqlens, state_v_first)


def _prefill_outputs_like(q, v, output_final_state, cu_seqlens, state_v_first):
    """A prefill's fake ``(o, final state)`` (its inputs' shapes checked): o like v in q's dtype; the fp32
    ``[N, HV, K, V]`` (``[N, HV, V, K]``) final state, or the op's empty stand-in for None (v's heads: KDA's HV,
    Lightning's H)."""
    o = _output_like(q, v)
    if not output_final_state:
        return o, _no_final_state(q)
    N = q.shape[0] if cu_seqlens is None else check_cu_seqlens_shape(cu_seqlens, q.shape[0])
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    return o, q.new_empty(shape, dtype=torch.float32)


# (each fake checks its inputs' shapes and dtypes first, as the Python API's validator does: under torch.compile a
# bad shape is the API's error naming the argument, raised while tracing)

def _kda_prefill_pool_fake(q, k, v, g, beta, state, state_indices, *args):
    check_kda_inputs(q, k, v, g, beta)
    return _output_like(q, v)


def _kda_decode_fake(q, k, v, g, beta, state, state_indices, *args):
    check_kda_inputs(q, k, v, g, beta)
    return _output_like(q, v)


def _kda_decode_out_fake(q, k, v, g, beta, state, state_indices, out, *args):
    check_kda_inputs(q, k, v, g, beta)
    return None


def _lightning_prefill_fake(q, k, v, g_gamma=None, layer_idx=None, num_layers=None, scale=None, initial_state=None,
                            output_final_state=False, cu_seqlens=None, state_v_first=False):
    check_lightning_inputs(q, k, v)
    return _prefill_outputs_like(q, v, output_final_state, cu_seqlens, state_v_first)


def _lightning_output_fake(q, k, v, *args, **kwargs):
    check_lightning_inputs(q, k, v)
    return _output_like(q, v)


def _lightning_decode_out_fake(q, k, v, *args, **kwargs):
    check_lightning_inputs(q, k, v)
    return None


_IMPLEMENTATIONS = {
    "kda_prefill": (_kda_prefill, _kda_prefill_fake),
    "kda_prefill_pool": (_kda_prefill_pool, _kda_prefill_pool_fake),
    "kda_decode": (_kda_decode, _kda_decode_fake),
    "kda_decode_out": (_kda_decode_out, _kda_decode_out_fake),
    "lightning_prefill": (_lightning_prefill, _lightning_prefill_fake),
    "lightning_prefill_pool": (_lightning_prefill_pool, _lightning_output_fake),
    "lightning_decode": (_lightning_decode, _lightning_output_fake),
    "lightning_decode_out": (_lightning_decode_out, _lightning_decode_out_fake),
}


def _on_q_device(name: str, fake):
    """``fake`` with the Python API's device check first: every tensor argument on q's device, but
    ``cu_seqlens_cpu``, the host copy of ``cu_seqlens``, on the CPU (``ValueError`` naming the first that is not). A
    call whose tensors mix a meta tensor with real ones dispatches to the fake (the meta kernel): without the check
    it would return uninitialised outputs on q's device."""
    arg_names = [argument.name for argument in torch._C.parse_schema(f"{NAMESPACE}::{name}{SCHEMAS[name]}").arguments]

    def checked(*args, **kwargs):
        device = args[0].device
        for arg_name, x in (*zip(arg_names, args, strict=False), *kwargs.items()):
            if not isinstance(x, torch.Tensor):
                continue
            if arg_name == "cu_seqlens_cpu":
                check_host_copy_device(x)
            elif x.device != device:
                raise ValueError(f"{arg_name} must be on q's device ({device}), got {x.device}")
        return fake(*args, **kwargs)

    return checked


def _defined(name: str) -> bool:
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _register() -> torch.library.Library | None:
    """Define and implement the ops (once per process: a second import of this module finds them defined)."""
    if _defined(OPS[0]):
        return None
    library = torch.library.Library(NAMESPACE, "DEF")
    for name in OPS:
        library.define(name + SCHEMAS[name])
        real, fake = _IMPLEMENTATIONS[name]
        # every device: the real implementation dispatches by the tensors' device itself (cula.dispatch)
        library.impl(name, real, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", _on_q_device(name, fake), lib=library)
    return library


# kept for the life of the process: dropping the Library object would remove the ops
_LIBRARY = _register()
