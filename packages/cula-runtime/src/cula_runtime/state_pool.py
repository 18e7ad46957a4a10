"""The slots of a KDA state pool that one call reads and writes (KDA_SPEC §10), from host copies of its index values.

A *pool* is a tensor ``[P, HV, K, V]`` (``[P, HV, V, K]`` V-first) of per-request states, read and written in place
at the slots a call's ``state_indices`` name. The rules, shared by ``kda_prefill`` (``state=``) and ``kda_decode``:

- ``state_indices`` ``[N]``: sequence ``n`` starts from slot ``idx[n]`` and its final state is written back there.
- ``state_indices`` ``[N, W]`` (decode only, speculative verification): sequence ``n`` starts from ``idx[n, 0]``, or
  from ``idx[n, num_accepted_tokens[n] - 1]`` when ``num_accepted_tokens`` is given; the state after its token ``t``
  is written to ``idx[n, t]`` (a negative entry: that token's state is not written). ``W`` must cover every
  sequence's length.
- A negative start slot makes sequence ``n`` a *padding row*: nothing is read or written for it and its output rows
  are zero.
- The entries a sequence *uses* are its start slot and, with ``[N, W]`` indices, the first ``T_n`` entries of its
  row. A used entry ``>= P``, a ``num_accepted_tokens[n]`` outside ``[1, W]`` or a ``T_n > W`` is refused
  (``ValueError``) where the values are checked on the host without a synchronisation (CPU tensors); a kernel that
  meets one on the device treats it as padding (the start slot, the count) or as a state not written (an entry past
  the start), so nothing outside the pool is ever touched.
- Duplicates: two sequences of one call may not use the same slot (each would read it and the writes would race):
  ``ValueError`` wherever the values are read on the host. Within one row of ``[N, W]`` indices a slot may repeat
  (the row's later token writes last).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PoolSlots", "pool_slots"]


@dataclass(frozen=True)
class PoolSlots:
    """Per sequence ``n`` of a call: ``start[n]``, the slot its start state is read from (``-1``: a padding row);
    ``final[n]``, the slot its final state is written to (``-1``: none: a padding row, or per-token slots);
    ``steps[n]`` (``[N, W]`` indices only, else None), for each of its ``T_n`` tokens the slot that token's state is
    written to (``-1``: not written)."""

    start: tuple[int, ...]
    final: tuple[int, ...]
    steps: tuple[tuple[int, ...], ...] | None

    @property
    def active(self) -> list[int]:
        """The sequences that are not padding rows."""
        return [n for n, slot in enumerate(self.start) if slot >= 0]


def _outside(strict: bool, where: str, slot: int, pool_size: int) -> int:
    """``-1`` for an entry past the pool (padding / not written), or ``ValueError`` when ``strict``."""
    if strict:
        raise ValueError(f"{where}={slot} is outside the pool of {pool_size} slots (state.shape[0]); a padding row "
                         "takes a negative index")
    return -1


def _start_of_row(row: list[int], n: int, accepted: list[int] | None, pool_size: int, strict: bool) -> int:
    width = len(row)
    column = 0
    if accepted is not None:
        count = accepted[n]
        if not 1 <= count <= width:
            if strict:
                raise ValueError(f"num_accepted_tokens[{n}]={count} must be in [1, {width}] (the columns of "
                                 "state_indices): the start state is read from state_indices[n, "
                                 "num_accepted_tokens[n] - 1]")
            return -1
        column = count - 1
    slot = row[column]
    if slot >= pool_size:
        return _outside(strict, f"state_indices[{n}, {column}]", slot, pool_size)
    return slot if slot >= 0 else -1


def _steps_of_row(row: list[int], n: int, length: int, pool_size: int, strict: bool) -> tuple[int, ...]:
    width = len(row)
    if length > width and strict:
        raise ValueError(f"sequence {n} has {length} tokens but state_indices has {width} columns (one slot per "
                         "token): state_indices must be [N, W] with W >= every sequence's length")
    steps = []
    for t in range(length):
        slot = row[t] if t < width else -1
        if slot >= pool_size:
            slot = _outside(strict, f"state_indices[{n}, {t}]", slot, pool_size)
        steps.append(slot if slot >= 0 else -1)
    return tuple(steps)


def pool_slots(indices: list, lens: list[int], pool_size: int, accepted: list[int] | None = None, *,
               per_token: bool, strict: bool) -> PoolSlots:
    """The slots each sequence of a call uses, by the module's rules.

    Args:
        indices: ``state_indices`` as Python ints: ``[N]``, or ``[N][W]`` with ``per_token`` (``tolist()`` of the
            tensor).
        lens: each sequence's token count ``T_n``.
        pool_size: ``P``, the pool's slot count.
        accepted: ``num_accepted_tokens`` as Python ints (``[N, W]`` indices only), or None.
        strict: refuse (``ValueError``) what a kernel treats as padding; False: treat it as padding, as on the device.

    Raises:
        ValueError: naming the entry (``state_indices[n]``, ``num_accepted_tokens[n]``) and the rule; a slot used by
        two sequences whatever ``strict`` says.
    """
    start, final, steps = [], [], []
    owner: dict[int, int] = {}
    for n, entry in enumerate(indices):
        if per_token:
            slot = _start_of_row(entry, n, accepted, pool_size, strict)
            row_steps = _steps_of_row(entry, n, lens[n], pool_size, strict) if slot >= 0 else (-1,) * lens[n]
            used = {slot, *row_steps} - {-1}
        else:
            slot = entry if entry < pool_size else _outside(strict, f"state_indices[{n}]", entry, pool_size)
            slot = slot if slot >= 0 else -1
            row_steps = ()
            used = {slot} - {-1}
        for used_slot in sorted(used):
            other = owner.setdefault(used_slot, n)
            if other != n:
                raise ValueError(f"state_indices: slot {used_slot} is used by sequences {other} and {n}; a slot may "
                                 "belong to one sequence of a call (padding rows take a negative index)")
        start.append(slot)
        final.append(-1 if per_token else slot)
        steps.append(row_steps)
    return PoolSlots(tuple(start), tuple(final), tuple(steps) if per_token else None)
