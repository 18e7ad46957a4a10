"""KDA decode on a state pool, in torch: the reference backend of ``kda_decode`` (KDA_SPEC §1.2, §6, §10).

Each sequence runs the per-token recurrence from its start slot of the pool and writes its states back in place, by
the rules of :mod:`cula_runtime.state_pool` (padding rows, per-token slots for speculative verification). The math
runs in float32 (the backend), or float64 (``compute_dtype``: the oracle path of the tests), on the pool's device;
the states are rounded to the pool's dtype only when they are written (a bf16 pool keeps the running state of a
multi-token sequence in the compute dtype between its tokens).

Host reads: the index tensors (and ``cu_seqlens``) are copied to the host once per call, so on a GPU this path
synchronises and cannot be captured in a CUDA graph; a slot past the pool is treated as padding there, as a kernel
would (on the CPU the validator has already refused it).
"""

from __future__ import annotations

import torch

from ..index import checked_cu_seqlens_host
from ..kda_args import sequence_lengths
from ..kda_decode_args import KdaDecodeArgs, decode_slots
from .kda_naive import recurrence_step
from .preprocess import expand_qk_heads, prepare_kda_inputs

__all__ = ["kda_decode_reference", "write_slots"]


def write_slots(state: torch.Tensor, slots: list[int], S: torch.Tensor, v_first: bool = False) -> None:
    """Store the K-first states ``S`` ``[len(slots), heads, K, V]`` in the pool's slots (transposed into a V-first
    pool with ``v_first``), rounded to its dtype and without autograd history (every reference backend's pool
    write)."""
    values = S.transpose(-1, -2) if v_first else S
    index = torch.tensor(slots, dtype=torch.int64, device=state.device)
    state.index_copy_(0, index, values.detach().to(state.dtype))  # (a pool holds no graph)


def kda_decode_reference(args: KdaDecodeArgs, *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Run ``kda_decode`` on validated arguments: update ``args.state`` in place and return ``o``.

    Args:
        args: from :func:`cula_runtime.kda_decode_args.validate_kda_decode`.
        compute_dtype: float32 (the backend) or float64 (the oracle path).

    Returns:
        ``o`` ``[B, T, HV, V]`` in q's dtype (``args.out`` when given), zero on padding rows.
    """
    B, T, HV, V, N = args.B, args.T, args.HV, args.V, args.N
    device = args.device
    cu_host = args.cu_seqlens_host
    if cu_host is None and args.cu_seqlens is not None:
        cu_host = checked_cu_seqlens_host(args.cu_seqlens, T)  # (a device cu_seqlens: one synchronisation)
    lens = sequence_lengths(N, T, cu_host)
    slots = args.slots
    if slots is None:
        slots = decode_slots(args.state_indices, args.num_accepted_tokens, lens, args.P, strict=False)
    firsts = [n * T for n in range(N)] if cu_host is None else cu_host.tolist()[:-1]  # each sequence's first token

    o = torch.zeros(B * T, HV, V, dtype=compute_dtype, device=device)
    rows = sorted((n for n in slots.active if lens[n] > 0), key=lambda n: -lens[n])  # longest first (stable)
    if rows:
        q, k, g, beta = prepare_kda_inputs(args.q, args.k, args.g, args.beta, dtype=compute_dtype,
                                           **args.preprocessing_kwargs())
        flat = [x.reshape(B * T, *x.shape[2:]) for x in (expand_qk_heads(q, HV), expand_qk_heads(k, HV),
                                                          args.v.to(compute_dtype), g, beta)]
        longest = lens[rows[0]]
        # token positions [R, longest]; past a row's end its first token stands in (never read: see `running`)
        positions = [[firsts[n] + min(t, lens[n] - 1) for t in range(longest)] for n in rows]
        index = torch.tensor(positions, dtype=torch.int64, device=device)
        qs, ks, vs, gs, bs = (x[index] for x in flat)  # [R, longest, HV, ...]
        start = torch.tensor([slots.start[n] for n in rows], dtype=torch.int64, device=device)
        S = args.state.index_select(0, start).to(compute_dtype)
        S = S.transpose(-1, -2).contiguous() if args.state_v_first else S  # K-first [R, HV, K, V]
        outputs = torch.zeros(len(rows), longest, HV, V, dtype=compute_dtype, device=device)
        for t in range(longest):
            running = sum(lens[n] > t for n in rows)  # the rows still running are a prefix (sorted by length)
            S_new, outputs[:running, t], _ = recurrence_step(S[:running], qs[:running, t], ks[:running, t],
                                                             vs[:running, t], gs[:running, t], bs[:running, t],
                                                             args.scale)
            S[:running] = S_new
            if slots.steps is not None:  # [N, W] indices: the state after token t goes to state_indices[n, t]
                written = [r for r in range(running) if slots.steps[rows[r]][t] >= 0]
                if written:
                    write_slots(args.state, [slots.steps[rows[r]][t] for r in written], S[written],
                           args.state_v_first)
        finals = [r for r, n in enumerate(rows) if slots.final[n] >= 0]
        if finals:
            write_slots(args.state, [slots.final[rows[r]] for r in finals], S[finals], args.state_v_first)
        done = [(r, t) for r, n in enumerate(rows) for t in range(lens[n])]
        o[[positions[r][t] for r, t in done]] = outputs[[r for r, _ in done], [t for _, t in done]]

    result = o.view(B, T, HV, V).to(args.q.dtype)
    if args.out is None:
        return result
    return args.out.copy_(result)
