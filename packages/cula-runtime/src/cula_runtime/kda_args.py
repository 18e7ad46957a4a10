"""Validation of ``kda_prefill`` arguments: the one validator shared by every backend.

``validate_kda_prefill`` checks every argument before any backend sees it and raises ``TypeError`` (wrong type or
dtype) or ``ValueError`` (wrong shape, size or value) with a message that names the argument and the value
expected. It returns a frozen :class:`KdaPrefillArgs` holding the tensors (made contiguous) and the problem sizes.

Strides: any strides are accepted; a non-contiguous input is copied to a contiguous tensor here, once, so every
backend receives dense row-major tensors. Pass contiguous tensors to avoid the copy. A state pool (``state=``) is
never copied (it is written in place): each of its slots must be dense, the stride between slots is free.

The checks that ``kda_decode``'s validator (:mod:`cula_runtime.kda_decode_args`) shares live here too: the inputs,
flags, scale, gate parameters and the state pool.
"""

from __future__ import annotations

import copy
import math
import numbers
from dataclasses import dataclass

import torch

from .index import checked_cu_seqlens_host
from .state_pool import PoolSlots, pool_slots

__all__ = ["KdaCallArgs", "KdaPrefillArgs", "validate_kda_prefill", "gpu_kernel_rejection", "gate_is_bounded",
           "empty_prefill_result", "checked_boundaries", "check_input_types", "check_kda_inputs", "check_flags",
           "check_devices", "check_scale", "check_gate", "check_cu_seqlens_shape", "check_state_pool",
           "check_writable", "check_apart", "check_host_copy_device",
           "sequence_lengths", "MAX_HEAD_DIM", "SAFE_GATE_LOWER_BOUND_MIN", "POOL_REFUSAL"]

MAX_HEAD_DIM = 256
SAFE_GATE_LOWER_BOUND_MIN = -5.0
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float64)
_PARAM_DTYPES = (torch.float32, torch.float64, torch.bfloat16)  # A_log, dt_bias
_CU_DTYPES = (torch.int32, torch.int64)  # the decode's and the Lightning ops' cu_seqlens


#: why the GPU prefill kernels do not serve a call with a state pool yet (their ``verify`` answer)
POOL_REFUSAL = "the state-pool form runs on the reference until the GPU kernels take slot indices (issue 26)"


@dataclass(frozen=True)
class KdaCallArgs:
    """What validated ``kda_prefill`` and ``kda_decode`` arguments have in common: the inputs (contiguous), the
    preprocessing flags and gate parameters, and the sizes.

    Sizes: ``B`` batch rows, ``T`` tokens per row, ``H`` q/k heads, ``HV`` value heads (``HV % H == 0``),
    ``K``/``V`` head dims, ``N`` sequences (``B`` without ``cu_seqlens``, else ``len(cu_seqlens) - 1``).
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    scale: float
    use_qk_l2norm_in_kernel: bool
    use_gate_in_kernel: bool
    use_beta_sigmoid_in_kernel: bool
    allow_neg_eigval: bool
    lower_bound: float | None
    A_log: torch.Tensor | None
    dt_bias: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    state_v_first: bool
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int

    @property
    def device(self) -> torch.device:
        return self.q.device

    def preprocessing_kwargs(self) -> dict:
        """The flags and gate parameters as keyword arguments of the reference's ``prepare_kda_inputs``."""
        return dict(use_qk_l2norm_in_kernel=self.use_qk_l2norm_in_kernel, use_gate_in_kernel=self.use_gate_in_kernel,
                    use_beta_sigmoid_in_kernel=self.use_beta_sigmoid_in_kernel,
                    allow_neg_eigval=self.allow_neg_eigval, lower_bound=self.lower_bound, A_log=self.A_log,
                    dt_bias=self.dt_bias)


@dataclass(frozen=True)
class KdaPrefillArgs(KdaCallArgs):
    """Validated ``kda_prefill`` arguments (tensors contiguous, except the pool) and the sizes derived from them.

    ``cu_seqlens_host``: the CPU copy of ``cu_seqlens`` the validator checked (None without ``cu_seqlens``), for the
    index helpers' ``host=`` (they then build on the host, with no further synchronisation).
    The pool form (``state`` not None): ``state`` the pool ``[P, HV, K, V]`` (``[P, HV, V, K]`` V-first) as passed,
    ``state_indices`` int32 ``[N]``, ``has_initial_state`` bool ``[N]`` or None; ``pool_slots`` the slots checked on
    the host (:func:`cula_runtime.state_pool.pool_slots`) when the indices are CPU tensors, else None.
    """

    initial_state: torch.Tensor | None
    output_final_state: bool
    safe_gate: bool
    cu_seqlens_host: torch.Tensor | None = None
    state: torch.Tensor | None = None
    state_indices: torch.Tensor | None = None
    has_initial_state: torch.Tensor | None = None
    pool_slots: PoolSlots | None = None

    @property
    def state_shape(self) -> tuple[int, int, int, int]:
        """Shape of ``initial_state`` / the final state: ``[N, HV, K, V]``, or ``[N, HV, V, K]`` if V-first."""
        return (self.N, self.HV, self.V, self.K) if self.state_v_first else (self.N, self.HV, self.K, self.V)

    def with_tensors(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
                     cu_seqlens: torch.Tensor | None, cu_seqlens_host: torch.Tensor | None, *,
                     state: torch.Tensor | None = None, state_indices: torch.Tensor | None = None,
                     has_initial_state: torch.Tensor | None = None) -> KdaPrefillArgs:
        """These arguments with another call's tensors, for a call plan (``cula.call_plans``): the tensors must have
        this call's signature, contiguous, and ``cu_seqlens_host`` must be their checked host copy
        (:func:`checked_boundaries`); a pool-form call's pool, indices and flags (on the GPU: no slot is checked on
        the host, ``pool_slots`` stays None). A ``[HV, K]`` ``dt_bias`` is flattened as the validator does. No check
        runs."""
        if dt_bias is not None and dt_bias.ndim != 1:
            dt_bias = dt_bias.view(-1)
        args = copy.copy(self)  # (a frozen dataclass: its fields are set the way its own __init__ sets them)
        for name, value in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("initial_state", initial_state),
                            ("A_log", A_log), ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens),
                            ("cu_seqlens_host", cu_seqlens_host), ("state", state), ("state_indices", state_indices),
                            ("has_initial_state", has_initial_state)):
            object.__setattr__(args, name, value)
        return args

    def reference_kwargs(self) -> dict:
        """Keyword arguments for the reference functions ``kda_naive`` / ``kda_chunked``."""
        return dict(
            q=self.q, k=self.k, v=self.v, g=self.g, beta=self.beta, scale=self.scale,
            initial_state=self.initial_state, output_final_state=self.output_final_state,
            cu_seqlens=self.cu_seqlens, state_v_first=self.state_v_first, **self.preprocessing_kwargs(),
        )


def type_name(x: object) -> str:
    """``x``'s type as a message names it: a builtin's bare name (``list``), any other with its module
    (``numpy.bool``, ``numpy.ndarray``), so that a NumPy bool is not reported as a ``bool``."""
    kind = type(x)
    return kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def real_number(x: object) -> bool:
    """Whether ``x`` is a real number a float argument takes: a Python or NumPy int or float, not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _tensor(name: str, x: object) -> torch.Tensor:
    """``x`` if it is a dense (strided) tensor; ``TypeError`` naming it otherwise (sparse layouts included)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type_name(x)}")
    if x.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    return x


def _dtype(name: str, x: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {x.dtype}")


def _shape(name: str, x: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {list(expected)} ({what}), got {list(x.shape)}")


def _flag(name: str, x: object) -> bool:
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be a bool, got {type_name(x)}")
    return x


_FLAG_NAMES = ("output_final_state", "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "use_beta_sigmoid_in_kernel",
               "allow_neg_eigval", "safe_gate", "state_v_first")


def check_flags(names: tuple[str, ...], flags: tuple[object, ...]) -> None:
    """``TypeError`` naming the first of ``flags`` (called ``names``) that is not a ``bool``."""
    for value in flags:
        if value.__class__ is not bool:  # bool has no subclasses: the same test as isinstance(value, bool)
            for name, flag in zip(names, flags, strict=True):
                _flag(name, flag)


def check_input_types(q: object, k: object, v: object, g: object, beta: object) -> None:
    """``TypeError`` naming the first of q, k, v, g, beta that is not a dense (strided) tensor."""
    Tensor, strided = torch.Tensor, torch.strided
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor) and isinstance(g, Tensor)
            and isinstance(beta, Tensor) and q.layout is strided and k.layout is strided and v.layout is strided
            and g.layout is strided and beta.layout is strided):
        for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            _tensor(name, x)


def check_kda_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     ) -> tuple[int, int, int, int, int, int]:
    """The shapes and dtypes of q, k ``[B, T, H, K]``, v ``[B, T, HV, V]``, g ``[B, T, HV, K]`` and beta
    ``[B, T, HV]`` (tensors: :func:`check_input_types`); returns ``(B, T, H, K, HV, V)``. Their devices are
    :func:`check_devices`' job."""
    q_shape = q.shape
    if len(q_shape) != 4:
        raise ValueError(f"q must be 4-D [B, T, H, K], got shape {list(q_shape)}")
    B, T, H, K = q_shape
    if k.shape != q_shape:
        _shape("k", k, (B, T, H, K), "the shape of q: [B, T, H, K]")
    v_shape = v.shape
    if len(v_shape) != 4 or v_shape[0] != B or v_shape[1] != T:
        raise ValueError(f"v must have shape [B={B}, T={T}, HV, V], got {list(v_shape)}")
    HV, V = v_shape[2], v_shape[3]
    if H == 0 or HV == 0 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a positive multiple of q/k's head count H={H} (GVA)")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        for name, size in (("K (q.shape[-1])", K), ("V (v.shape[-1])", V)):
            if not 1 <= size <= MAX_HEAD_DIM:
                raise ValueError(f"head dim {name} must be in [1, {MAX_HEAD_DIM}], got {size}")
    if g.shape != (B, T, HV, K):
        _shape("g", g, (B, T, HV, K), "[B, T, HV, K]")
    if beta.shape != (B, T, HV):
        _shape("beta", beta, (B, T, HV), "[B, T, HV]")

    dtype = q.dtype
    if dtype not in _INPUT_DTYPES:
        _dtype("q", q, _INPUT_DTYPES)
    for name, x in (("k", k), ("v", v)):
        if x.dtype != dtype:
            raise TypeError(f"{name} must have the dtype of q ({dtype}), got {x.dtype}")
    if g.dtype not in _INPUT_DTYPES:
        _dtype("g", g, _INPUT_DTYPES)
    if beta.dtype not in _INPUT_DTYPES:
        _dtype("beta", beta, _INPUT_DTYPES)
    return B, T, H, K, HV, V


def check_devices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  optional: tuple[tuple[str, object], ...]) -> None:
    """k, v, g, beta and each ``(name, tensor or None)`` of ``optional`` on q's device (``TypeError`` for an optional
    argument that is neither a tensor nor None, ``ValueError`` naming the one on another device)."""
    device = q.device
    checked = (("k", k), ("v", v), ("g", g), ("beta", beta))
    if k.device == device and v.device == device and g.device == device and beta.device == device:
        checked = ()  # the four required tensors share q's device; only the optional ones are left
    for name, x in (*checked, *optional):
        if x is None:
            continue
        _tensor(name, x)
        if x.device != device:
            raise ValueError(f"{name} must be on q's device ({device}), got {x.device}")


def check_scale(scale: object, K: int) -> float:
    """``scale`` as a float (``None``: ``K ** -0.5``); ``TypeError``/``ValueError`` unless finite and positive."""
    if scale is None:
        return K**-0.5
    if not real_number(scale):
        raise TypeError(f"scale must be a float or None (default K**-0.5), got {type_name(scale)}")
    try:
        value = float(scale)
    except OverflowError:  # (an int or Fraction past float's range)
        value = math.inf
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"scale must be a finite positive float or None (default K**-0.5), got {scale}"
                         + ("" if value == scale else f" (as a float: {value})"))
    return value


def check_cu_seqlens_shape(cu_seqlens: torch.Tensor, B: int) -> int:
    """``cu_seqlens`` 1-D ``[N + 1]`` with ``N >= 1`` and a packed batch (``B == 1``); returns ``N``. Its dtype and
    values are each caller's to check."""
    if cu_seqlens.ndim != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [N+1] with N >= 1, got shape {list(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed: B must be 1, got B={B}")
    return cu_seqlens.numel() - 1


def check_packed_cu_seqlens(cu_seqlens: torch.Tensor, B: int) -> int:
    """``cu_seqlens`` int32 or int64 ``[N + 1]`` of a packed batch (:func:`check_cu_seqlens_shape`); returns ``N``.
    Its values are each caller's to check."""
    if cu_seqlens.dtype not in _CU_DTYPES:
        raise TypeError(f"cu_seqlens must have dtype torch.int32 or torch.int64, got {cu_seqlens.dtype}")
    return check_cu_seqlens_shape(cu_seqlens, B)


def check_decode_cu_seqlens(cu_seqlens: torch.Tensor | None, B: int, T: int) -> tuple[int, torch.Tensor | None]:
    """A decode call's ``cu_seqlens`` (int32 or int64 ``[N + 1]``, ``B == 1``) or None (``N = B``); returns ``(N,
    host boundaries or None)``. Its values are checked only when it is a CPU tensor: on a GPU they are never read
    (no synchronisation; a CUDA graph replays the call with new values)."""
    if cu_seqlens is None:
        return B, None
    N = check_packed_cu_seqlens(cu_seqlens, B)
    cu_host = checked_cu_seqlens_host(cu_seqlens, T) if cu_seqlens.device.type == "cpu" else None
    return N, cu_host


def check_out(out: torch.Tensor | None, q: torch.Tensor, shape: tuple[int, ...], dims: str) -> None:
    """``out`` (None, or written in place): q's dtype, ``shape`` (``dims`` names it, e.g. ``"[B, T, HV, V]"``),
    contiguous, writable (:func:`check_writable`: checked before the pool is touched, so a refused ``out`` leaves the
    states as they were)."""
    if out is None:
        return
    check_writable("out", out)
    if out.dtype != q.dtype:
        raise TypeError(f"out must have the dtype of q ({q.dtype}), got {out.dtype}")
    if out.shape != shape:
        raise ValueError(f"out must have shape {dims}=[{', '.join(map(str, shape))}], got {list(out.shape)}")
    if not out.is_contiguous():
        raise ValueError(f"out must be contiguous (it is written in place), got strides {list(out.stride())}")


def check_writable(name: str, x: torch.Tensor) -> None:
    """A tensor the call writes in place (a pool, ``out``): not one that requires grad while grad mode is on (the
    kernels record no graph, and torch refuses an in-place write to a leaf that requires grad), nor an
    inference-mode tensor outside inference mode (torch refuses writes to it there): ``ValueError`` naming it, before
    anything runs."""
    if x.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name} is written in place and must not require grad while grad mode is enabled; pass a "
                         f"tensor that does not (e.g. x.detach() of the same memory) or call under torch.no_grad()")
    if x.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(f"{name} is an inference-mode tensor, which torch lets no one write outside "
                         f"torch.inference_mode(); call under torch.inference_mode() or pass a normal tensor")


def _memory_span(x: torch.Tensor) -> tuple[int, int] | None:
    """The byte range ``[first, end)`` a tensor's elements lie in (None: no elements, no memory (meta), or a tensor
    subclass that has no data pointer)."""
    if x.numel() == 0 or x.device.type == "meta":
        return None
    try:
        start = x.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    last = sum((n - 1) * stride for n, stride in zip(x.shape, x.stride(), strict=True))
    return start, start + (last + 1) * x.element_size()


def check_apart(written: tuple[tuple[str, torch.Tensor | None], ...],
                others: tuple[tuple[str, torch.Tensor | None], ...]) -> None:
    """Each tensor a call writes in place (``written``: the pool, ``out``) shares no memory with any other tensor
    argument (``others``, and the other written ones): a kernel would read what it, or another of its CTAs, is
    writing. ``ValueError`` naming both. Conservative: two views whose elements interleave within one range count as
    overlapping."""
    spans = [(name, _memory_span(x)) for name, x in (*written, *others) if x is not None]
    spans = [(name, span) for name, span in spans if span is not None]
    writers = {name for name, x in written if x is not None}
    for i, (name, (start, end)) in enumerate(spans):
        for other, (other_start, other_end) in spans[i + 1:]:
            if (name in writers or other in writers) and start < other_end and other_start < end:
                raise ValueError(f"{name} and {other} share memory, and the call writes "
                                 f"{name if name in writers else other} in place: pass tensors that do not overlap")


def check_pool_form(state: object, state_indices: object, initial_state: object, output_final_state: bool,
                    heads: str = "HV") -> None:
    """A prefill's pool form (any of ``state``, ``state_indices``, ``has_initial_state`` given): ``state`` is given,
    ``initial_state`` and ``output_final_state`` are not. ``heads``: the head dim's name in the messages."""
    if state is None:
        name = "state_indices" if state_indices is not None else "has_initial_state"
        raise ValueError(f"{name} is only used with state (the pool [P, {heads}, K, V] it indexes); pass state too")
    if initial_state is not None:
        raise ValueError("initial_state and state are exclusive: with a pool (state=), each sequence starts from "
                         "its slot state[state_indices[n]]; pass initial_state=None")
    if output_final_state:
        raise ValueError("output_final_state=True and state are exclusive: with a pool (state=), the final states "
                         "are written to the pool in place; pass output_final_state=False")


def check_has_initial_state(has_initial_state: torch.Tensor | None, N: int) -> None:
    """``has_initial_state``: None, or bool ``[N]`` (one flag per sequence)."""
    if has_initial_state is None:
        return
    if has_initial_state.dtype != torch.bool:
        raise TypeError(f"has_initial_state must have dtype torch.bool, got {has_initial_state.dtype}")
    if has_initial_state.shape != (N,):
        _shape("has_initial_state", has_initial_state, (N,), "[N], one flag per sequence")


def check_gate(use_gate_in_kernel: bool, use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool,
               safe_gate: bool | None, lower_bound: object, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
               HV: int, K: int) -> tuple[float | None, torch.Tensor | None]:
    """The beta and gate arguments: ``allow_neg_eigval`` needs the sigmoid; ``lower_bound``, ``A_log`` and
    ``dt_bias`` as the gate form needs them (``safe_gate=None``: the op has no ``safe_gate`` argument, as
    ``kda_decode``). Returns ``(lower_bound as a float or None, dt_bias flattened to [HV * K] or None)``."""
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("allow_neg_eigval=True requires use_beta_sigmoid_in_kernel=True (beta = 2*sigmoid(beta))")

    if lower_bound is not None:
        if not real_number(lower_bound):
            raise TypeError(f"lower_bound must be a float or None, got {type_name(lower_bound)}")
        if not (use_gate_in_kernel or safe_gate):
            if safe_gate is None:
                raise ValueError("lower_bound is only used with use_gate_in_kernel=True (the lower-bound gate form); "
                                 f"got lower_bound={lower_bound} with use_gate_in_kernel=False")
            raise ValueError(
                "lower_bound is only used with use_gate_in_kernel=True (the safe gate form) or safe_gate=True; "
                f"got lower_bound={lower_bound} with both False"
            )
        lower_bound = float(lower_bound)
        if not (math.isfinite(lower_bound) and lower_bound < 0):
            raise ValueError(f"lower_bound must be a finite negative float, got {lower_bound}")
    if use_gate_in_kernel:
        if safe_gate:
            if lower_bound is None:
                raise ValueError("safe_gate=True with use_gate_in_kernel=True requires lower_bound in [-5, 0)")
            if lower_bound < SAFE_GATE_LOWER_BOUND_MIN:
                raise ValueError(f"safe_gate=True requires lower_bound in [-5, 0), got {lower_bound}")
        if A_log is None and lower_bound is None:
            raise ValueError("use_gate_in_kernel=True requires A_log (shape [HV]) unless lower_bound is set")
        if A_log is not None:
            if A_log.shape != (HV,):
                _shape("A_log", A_log, (HV,), "[HV]")
            if A_log.dtype not in _PARAM_DTYPES:
                _dtype("A_log", A_log, _PARAM_DTYPES)
        if dt_bias is not None:
            flat = dt_bias.ndim == 1
            if not ((flat and dt_bias.numel() == HV * K) or dt_bias.shape == (HV, K)):
                raise ValueError(f"dt_bias must have shape [HV*K]=[{HV * K}] or [HV, K]=[{HV}, {K}], got "
                                 f"{list(dt_bias.shape)}")
            if dt_bias.dtype not in _PARAM_DTYPES:
                _dtype("dt_bias", dt_bias, _PARAM_DTYPES)
            if not flat:  # a 1-D dt_bias already has the [HV*K] shape
                dt_bias = dt_bias.reshape(HV * K)
    else:
        for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
            if x is not None:
                raise ValueError(f"{name} is only used with use_gate_in_kernel=True; pass {name}=None or enable it")
    return lower_bound, dt_bias


def _slots_dense(state: torch.Tensor) -> bool:
    """Whether each slot ``state[p]`` is dense row-major (dims of size 1 take any stride); the slot stride is free."""
    expected = 1
    for size, stride in zip(reversed(state.shape[1:]), reversed(state.stride()[1:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def check_state_pool(state: object, state_indices: object, N: int, HV: int, K: int, V: int, state_v_first: bool,
                     per_token_allowed: bool, heads: str = "HV") -> tuple[int, bool]:
    """A state pool and its indices (devices checked by :func:`check_devices`): ``state`` ``[P, HV, K, V]``
    (``[P, HV, V, K]`` with ``state_v_first``) in fp32, bf16 or fp64 with dense slots; ``state_indices`` int32
    ``[N]``, or ``[N, W]`` (``W >= 1``) when ``per_token_allowed``. Returns ``(P, per_token)``. The index values
    are :func:`cula_runtime.state_pool.pool_slots`' to check. ``heads``: the head dim's name in the messages (the
    Lightning ops' is ``H``)."""
    if state_indices is None:
        raise ValueError("state (the pool) needs state_indices: an int32 tensor [N] naming each sequence's slot")
    state = _tensor("state", state)
    state_indices = _tensor("state_indices", state_indices)
    inner = (HV, V, K) if state_v_first else (HV, K, V)
    if state.ndim != 4 or tuple(state.shape[1:]) != inner:
        dims = f"[P, {heads}, V, K]" if state_v_first else f"[P, {heads}, K, V]"
        raise ValueError(f"state (the pool) must have shape [P, {', '.join(map(str, inner))}] ({dims}, "
                         f"state_v_first={state_v_first}), got {list(state.shape)}")
    if state.dtype not in _STATE_DTYPES:
        _dtype("state", state, _STATE_DTYPES)
    if not _slots_dense(state):
        raise ValueError(f"state (the pool) is written in place, so it is never copied: each slot state[p] must be "
                         f"dense row-major (the slot stride is free), got strides {list(state.stride())}")
    slot_size = inner[0] * inner[1] * inner[2]
    if state.shape[0] > 1 and state.stride(0) < slot_size:
        raise ValueError(f"state (the pool) is written in place: its slots must not overlap, so the slot stride must "
                         f"be at least a slot's {slot_size} elements, got strides {list(state.stride())}")
    check_writable("state (the pool)", state)
    if state_indices.dtype != torch.int32:
        raise TypeError(f"state_indices must have dtype torch.int32, got {state_indices.dtype}")
    per_token = state_indices.ndim == 2
    if not ((state_indices.ndim == 1 or (per_token and per_token_allowed)) and state_indices.shape[0] == N
            and (not per_token or state_indices.shape[1] >= 1)):
        forms = (f"[N]=[{N}] (one slot per sequence) or [N, W]=[{N}, W >= 1] (a slot per token, speculative "
                 "verification)") if per_token_allowed else f"[N]=[{N}] (one slot per sequence)"
        raise ValueError(f"state_indices must have shape {forms}, got {list(state_indices.shape)}")
    return state.shape[0], per_token


def check_host_copy_device(cu_seqlens_cpu: torch.Tensor) -> None:
    """``ValueError`` unless ``cu_seqlens_cpu`` (the host copy of ``cu_seqlens``) is a CPU tensor."""
    if cu_seqlens_cpu.device.type != "cpu":
        raise ValueError(f"cu_seqlens_cpu must be a CPU tensor (the host copy of cu_seqlens), got device "
                         f"{cu_seqlens_cpu.device}")


def _checked_cpu_copy(cu_seqlens_cpu: object, cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """``cu_seqlens_cpu`` checked as the host copy of ``cu_seqlens`` (a CPU int32 tensor of its shape) holding valid
    boundaries for ``T`` tokens; returns the checked copy (cached per tensor and version)."""
    if not isinstance(cu_seqlens_cpu, torch.Tensor):
        raise TypeError(f"cu_seqlens_cpu must be a torch.Tensor or None, got {type_name(cu_seqlens_cpu)}")
    check_host_copy_device(cu_seqlens_cpu)
    if cu_seqlens_cpu.dtype != torch.int32:
        raise TypeError(f"cu_seqlens_cpu must have dtype torch.int32, got {cu_seqlens_cpu.dtype}")
    if cu_seqlens_cpu.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cpu must have the shape of cu_seqlens ({list(cu_seqlens.shape)}), got "
                         f"{list(cu_seqlens_cpu.shape)}")
    try:
        return checked_cu_seqlens_host(cu_seqlens_cpu, T)
    except ValueError as error:
        raise ValueError(f"cu_seqlens_cpu: {error}") from None


def checked_boundaries(cu_seqlens: torch.Tensor, cu_seqlens_cpu: object, T: int) -> torch.Tensor:
    """The checked host copy of a varlen call's boundaries (int32 CPU ``[N + 1]``): ``cu_seqlens_cpu`` checked as
    the copy of ``cu_seqlens`` when given (``cu_seqlens`` itself is then never read: no synchronisation), else
    ``cu_seqlens`` copied to the host and checked (one synchronisation per tensor and version, cached). ``T``: the
    packed length. The validator's check of the values, also run on every call a cached call plan serves.

    Raises:
        TypeError, ValueError: naming ``cu_seqlens`` or ``cu_seqlens_cpu`` and the bad entry.
    """
    if cu_seqlens_cpu is None:
        return checked_cu_seqlens_host(cu_seqlens, T)
    return _checked_cpu_copy(cu_seqlens_cpu, cu_seqlens, T)


def validate_kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_v_first: bool = False,
    cu_seqlens_cpu: torch.Tensor | None = None,
    state: torch.Tensor | None = None,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
) -> KdaPrefillArgs:
    """Check every ``kda_prefill`` argument (see ``cula.kda.kda_prefill`` for their meaning).

    Raises ``TypeError`` or ``ValueError`` naming the argument and the expected value; returns the validated,
    contiguous arguments (the pool ``state`` as passed).

    Every call pays this on the host, so each check is a plain comparison on the accepting path and builds its
    message only when it fails; the checks run in a fixed order (the first failing one raises).
    """
    check_input_types(q, k, v, g, beta)
    flags = (output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
             allow_neg_eigval, safe_gate, state_v_first)
    check_flags(_FLAG_NAMES, flags)
    B, T, H, K, HV, V = check_kda_inputs(q, k, v, g, beta)
    optional = (("initial_state", initial_state), ("A_log", A_log), ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens))
    pooled = state is not None or state_indices is not None or has_initial_state is not None
    if pooled:
        optional += (("state", state), ("state_indices", state_indices), ("has_initial_state", has_initial_state))
    check_devices(q, k, v, g, beta, optional)
    scale = check_scale(scale, K)

    if cu_seqlens is not None:
        if cu_seqlens.dtype != torch.int32:
            raise TypeError(f"cu_seqlens must have dtype torch.int32, got {cu_seqlens.dtype}")
        N = check_cu_seqlens_shape(cu_seqlens, B)
        cu_host = checked_boundaries(cu_seqlens, cu_seqlens_cpu, T)
    else:
        if cu_seqlens_cpu is not None:
            raise ValueError("cu_seqlens_cpu is the host copy of cu_seqlens: pass cu_seqlens (on q's device) with it")
        N = B
        cu_host = None

    if initial_state is not None:
        state_shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if initial_state.shape != state_shape:
            state_dims = "[N, HV, V, K]" if state_v_first else "[N, HV, K, V]"
            _shape("initial_state", initial_state, state_shape, f"{state_dims}, state_v_first={state_v_first}")
        if initial_state.dtype not in _STATE_DTYPES:
            _dtype("initial_state", initial_state, _STATE_DTYPES)

    slots = None
    if pooled:
        slots = _prefill_pool(state, state_indices, has_initial_state, initial_state, output_final_state, N, T, HV,
                              K, V, state_v_first, cu_host)
        check_apart((("state", state),), (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("A_log", A_log),
                                          ("dt_bias", dt_bias), ("cu_seqlens", cu_seqlens),
                                          ("state_indices", state_indices), ("has_initial_state", has_initial_state)))

    lower_bound, dt_bias = check_gate(use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate,
                                      lower_bound, A_log, dt_bias, HV, K)

    # contiguous() returns the tensor itself when it already is (the usual case), else a dense copy
    return KdaPrefillArgs(
        q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.contiguous(), beta=beta.contiguous(),
        scale=scale, initial_state=None if initial_state is None else initial_state.contiguous(),
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_gate_in_kernel=use_gate_in_kernel, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
        allow_neg_eigval=allow_neg_eigval, safe_gate=safe_gate, lower_bound=lower_bound,
        A_log=None if A_log is None else A_log.contiguous(), dt_bias=None if dt_bias is None else dt_bias.contiguous(),
        cu_seqlens=None if cu_seqlens is None else cu_seqlens.contiguous(), state_v_first=state_v_first,
        B=B, T=T, H=H, HV=HV, K=K, V=V, N=N, cu_seqlens_host=cu_host, state=state,
        state_indices=None if state_indices is None else state_indices.contiguous(),
        has_initial_state=None if has_initial_state is None else has_initial_state.contiguous(), pool_slots=slots,
    )


def sequence_lengths(N: int, T: int, cu_host: torch.Tensor | None) -> list[int]:
    """Each sequence's token count: ``T`` each for a fixed-length batch, else from the host boundaries."""
    if cu_host is None:
        return [T] * N
    bounds = cu_host.tolist()
    return [end - begin for begin, end in zip(bounds, bounds[1:], strict=False)]


def _prefill_pool(state: object, state_indices: object, has_initial_state: object,
                  initial_state: torch.Tensor | None, output_final_state: bool, N: int, T: int, HV: int, K: int,
                  V: int, state_v_first: bool, cu_host: torch.Tensor | None) -> PoolSlots | None:
    """The pool arguments of ``kda_prefill``; the slots checked on the host when the indices are CPU tensors."""
    check_pool_form(state, state_indices, initial_state, output_final_state)
    pool_size, _ = check_state_pool(state, state_indices, N, HV, K, V, state_v_first, per_token_allowed=False)
    check_has_initial_state(has_initial_state, N)
    if state_indices.device.type != "cpu":
        return None  # (reading the values would synchronise: the backend treats a slot past the pool as padding)
    return pool_slots(state_indices.tolist(), sequence_lengths(N, T, cu_host), pool_size, per_token=False,
                      strict=True)


def gate_is_bounded(args: KdaPrefillArgs) -> bool:
    """Whether every log-gate of the call lies in [-5, 0] (the safe gate, KDA_SPEC §3.7), so that the intra kernels'
    sub-chunk-anchored diagonal blocks stay inside fp32/bf16 range: the in-kernel form with ``lower_bound >= -5``, or
    a precomputed ``g`` with ``safe_gate=True`` (and ``lower_bound``, if given, ``>= -5``). Every other call (the
    in-kernel softplus form, ``lower_bound < -5``, a precomputed ``g`` without ``safe_gate``) needs the GPU backends'
    unbounded-gate form."""
    lb = args.lower_bound
    if args.use_gate_in_kernel:
        return lb is not None and lb >= SAFE_GATE_LOWER_BOUND_MIN
    return args.safe_gate and (lb is None or lb >= SAFE_GATE_LOWER_BOUND_MIN)


def gpu_kernel_rejection(args: KdaPrefillArgs, head_dim: int = 128) -> str | None:
    """Why the GPU KDA kernels (bf16, K = V = ``head_dim``, fp32/bf16 g, beta and initial state) cannot serve
    ``args``, or None if they can. Every gate form passes (:func:`gate_is_bounded` tells which kernel form runs).

    Shared by the sm90 and cutedsl backends' ``verify``; each adds its own device and installation checks (and, until
    its kernels take slot indices, its refusal of the state-pool form, :data:`POOL_REFUSAL`).
    """
    if args.q.dtype != torch.bfloat16:
        return f"needs bf16 q/k/v, got {args.q.dtype}"
    if (args.K, args.V) != (head_dim, head_dim):
        return f"needs K = V = {head_dim}, got K={args.K} V={args.V}"
    for name in ("g", "beta"):
        dtype = getattr(args, name).dtype
        if dtype not in (torch.float32, torch.bfloat16):
            return f"needs {name} in fp32 or bf16, got {dtype}"
    if args.initial_state is not None and args.initial_state.dtype not in (torch.float32, torch.bfloat16):
        return f"needs initial_state in fp32 or bf16, got {args.initial_state.dtype}"
    return None


def empty_prefill_result(args: KdaPrefillArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The result of a call with no tokens (``B * T == 0``), shared by the GPU backends, which launch nothing for it:
    an empty ``o`` ``[B, T, HV, V]`` in q's dtype, and each sequence's state passed through as the final state (fp32,
    a copy of ``initial_state``; zeros without one), or None when it is not asked for."""
    o = torch.empty(args.B, args.T, args.HV, args.V, dtype=args.q.dtype, device=args.device)
    if not args.output_final_state:
        return o, None
    if args.initial_state is None:
        return o, torch.zeros(args.state_shape, dtype=torch.float32, device=args.device)
    return o, args.initial_state.float().clone()
