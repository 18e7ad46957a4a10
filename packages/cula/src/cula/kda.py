"""Kimi Delta Attention: the public prefill API (FLA-compatible names) and the varlen index helpers."""

from __future__ import annotations

import torch

from cula_runtime.index import prepare_chunk_indices, prepare_chunk_offsets, prepare_lens
from cula_runtime.kda_args import KdaPrefillArgs, checked_boundaries, validate_kda_prefill

from .call_plans import call_signature, lookup, remember, with_current_knobs
from .dispatch import planner_for, select_backend

__all__ = ["kda_prefill", "prepare_lens", "prepare_chunk_indices", "prepare_chunk_offsets"]


def kda_prefill(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward over whole sequences (prefill), on the best backend for the tensors' device.

    Args:
        q, k: ``[B, T, H, K]`` queries and keys (bf16, fp16 or fp32; one dtype for q, k, v).
        v: ``[B, T, HV, V]`` values; ``HV`` must be a multiple of ``H`` (GVA: value head ``hv`` reads q/k head
            ``hv // (HV // H)``).
        g: ``[B, T, HV, K]`` per-channel log-decay (``<= 0``), or the raw gate when ``use_gate_in_kernel``.
        beta: ``[B, T, HV]`` step sizes (bf16 or fp32), or logits when ``use_beta_sigmoid_in_kernel``.
        scale: query scale; ``None`` means ``K ** -0.5``.
        initial_state: ``[N, HV, K, V]`` (``[N, HV, V, K]`` if ``state_v_first``), fp32 (bf16 accepted), one per
            sequence; ``None`` means zeros.
        output_final_state: also return the final state (fp32, same layout as ``initial_state``).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head (``x / sqrt(sum x^2 + 1e-6)``).
        use_gate_in_kernel: compute the log gate from the raw ``g``: ``-exp(A_log) * softplus(g + dt_bias)``, or
            with ``lower_bound`` set, ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)`` (``2 * sigmoid`` with ``allow_neg_eigval``).
        safe_gate: the gate is bounded in ``[lower_bound, 0]`` with ``lower_bound >= -5`` (lets kernels use
            tensor cores on the diagonal blocks). With ``use_gate_in_kernel`` it requires ``lower_bound``.
        A_log: ``[HV]`` fp32, for the in-kernel gate. dt_bias: ``[HV * K]`` or ``[HV, K]`` fp32, optional.
        cu_seqlens: int32 ``[N + 1]`` cumulative lengths of a packed batch (then ``B`` must be 1).
        state_v_first: states laid out ``[N, HV, V, K]``.
        cu_seqlens_cpu: the same boundaries as ``cu_seqlens`` in a CPU int32 tensor, if the caller has them (a
            serving engine builds its batches on the host). The checks and the chunk indices then read this copy,
            and a call with a new ``cu_seqlens`` makes no synchronising call; without it, each new ``cu_seqlens``
            is copied to the host once (one synchronisation). Its values are not compared with
            ``cu_seqlens``' (that would synchronise): they must be equal.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, HV, V]`` in q's dtype; ``final_state`` fp32 or ``None``.

    Any strides are accepted (non-contiguous inputs are copied once). Bad arguments raise ``TypeError`` or
    ``ValueError`` naming the argument; a call no backend can serve raises ``NotImplementedError`` saying which
    backends were tried and why. ``CULA_BACKEND=reference|cutedsl|sm90`` forces a backend. A call with the signature
    of an earlier accepted one (tensors' shapes, strides, dtypes and devices, the flags, ``scale``, ``lower_bound``,
    the ``CULA_*`` variables) runs the call plan that call's backend left, without validation and dispatch; it still
    checks ``cu_seqlens``' values (``cula.call_plans``).
    """
    # positional: the same order as validate_kda_prefill's parameters (keywords cost a little on every call)
    signature = call_signature(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, cu_seqlens,
        state_v_first, cu_seqlens_cpu,
    )
    if signature is not None:
        plan = lookup(signature)
        if plan is not None:  # a call of this signature passed the checks and dispatch before (cula.call_plans)
            # cu_seqlens' values are checked on every call, as the validator does (ValueError before any launch)
            cu_host = None if cu_seqlens is None else checked_boundaries(cu_seqlens, cu_seqlens_cpu, q.shape[1])
            return plan(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, cu_host)
    args = validate_kda_prefill(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
        use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound, A_log, dt_bias, cu_seqlens,
        state_v_first, cu_seqlens_cpu,
    )
    runner = select_backend(args)
    if signature is not None and _passed_as_is(args, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens):
        planner = planner_for(runner)
        plan = None if planner is None else planner(args)
        if plan is not None:
            result = plan(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, args.cu_seqlens_host)
            # kept under the knobs as they are after its first run (which may read a knob for the first time)
            remember(with_current_knobs(signature), plan)
            return result
    return runner(args)


def _passed_as_is(args: KdaPrefillArgs, q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens) -> bool:
    """Whether the validator kept every tensor as passed (contiguous: no copy), which a plan relies on (it takes
    the call's tensors; a flattened ``dt_bias`` is a view of the same memory)."""
    return (args.q is q and args.k is k and args.v is v and args.g is g and args.beta is beta
            and args.initial_state is initial_state and args.A_log is A_log and args.cu_seqlens is cu_seqlens
            and (dt_bias is None or dt_bias.is_contiguous()))
