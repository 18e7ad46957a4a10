"""The "levels" split of a diagonal 16x16 score block for unbounded gates (KDA_SPEC §3.7): which (token, anchor)
pair each row slot and column slot of the two tensor-core products holds. Pure Python (no CuTeDSL): the intra
kernel packs these tables into constants at trace time, and the CPU tests check them.

A strict pair ``i > j`` of a 16-token sub-chunk (local indices) belongs to level ``b``, the highest bit where ``i``
and ``j`` differ; its anchor is ``m = i`` with the bits below ``b`` cleared, so ``j < m <= i`` and
``q_i k_j 2^(Γi - Γj) = [q_i 2^(Γi - Γm)] [k_j 2^(Γm - Γj)]`` with both factors <= 1 for a non-increasing ``Γ``. At
level ``b`` each token ``l`` has one role around the anchor ``((l >> b) | 1) << b``: a row if bit ``b`` of ``l`` is
set, else a column. Levels 3 and 2 share product 0, levels 1 and 0 product 1: each product's 16 row slots (the
MMA's A operand) and 16 column slots (its B operand) hold the two levels' rows and columns.

An anchor names its level (level ``b``'s anchors are the odd multiples of ``2^b``), so a product's output ``(row
slot, column slot)`` is one of the block's pairs exactly when the two slots share their anchor; the pair is then
``(row token, column token)``.

The kernel builds the products' operands from the tokens' side (:func:`level_slots`): the threads holding token ``l``
write, for each level, its row (``x_l 2^(Γl - Γm)``, of q and of k) or its column (``k_l 2^(Γm - Γl)``) into the
slot that level gives it, so every factor is made once and shared by Aqk and Akk.
"""

from __future__ import annotations

__all__ = ["DIAG_SIZE", "LEVELS", "diag_products", "level_anchor", "level_product", "level_slots", "pack_nibbles",
           "useful_outputs"]

DIAG_SIZE = 16  # tokens of a sub-chunk: the M = N of one diagonal block
LEVELS = 4  # bits of a local index: levels 0..3


def _row_slot(product: int, r: int) -> tuple[int, int]:
    """(token, anchor) of row slot ``r`` of ``product``."""
    if product == 0:  # level 2 rows of tokens 12..15 and 4..7, level 3 rows of 8..15
        if r < 4:
            return 12 + r, 12
        return (r, 4) if r < 8 else (r, 8)
    if r & 2:  # level 1 rows
        return r, r & ~1
    if r & 1:  # level 0 rows 1, 5, 9, 13 (their own anchor)
        return r, r
    return r + 3, r + 3  # level 0 rows 3, 7, 11, 15 (their own anchor)


def _col_slot(product: int, c: int) -> tuple[int, int]:
    """(token, anchor) of column slot ``c`` of ``product``."""
    if product == 0:  # level 3 columns of tokens 0..7, level 2 columns of 8..11 and 0..3
        if c < 8:
            return c, 8
        return (c, 12) if c < 12 else (c - 12, 4)
    if not c & 2:  # level 1 columns
        return c, (c | 2) & ~1
    if not c & 1:  # level 0 columns 2, 6, 10, 14
        return c, c + 1
    return c - 3, c - 2  # level 0 columns 0, 4, 8, 12


def diag_products() -> tuple[tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]], ...]:
    """``((row slots, column slots), ...)`` of products 0 and 1: 16 ``(token, anchor)`` pairs each. A row slot's
    factor is ``2^(Γ_token - Γ_anchor)``, a column slot's ``2^(Γ_anchor - Γ_token)``."""
    return tuple((tuple(_row_slot(p, s) for s in range(DIAG_SIZE)), tuple(_col_slot(p, s) for s in range(DIAG_SIZE)))
                 for p in range(2))


def useful_outputs(product: int) -> dict[tuple[int, int], tuple[int, int]]:
    """``(row slot, column slot) -> (i, j)``: the outputs of ``product`` that are pairs of the block."""
    rows, cols = diag_products()[product]
    return {(rs, cs): (rows[rs][0], cols[cs][0])
            for rs in range(DIAG_SIZE) for cs in range(DIAG_SIZE) if rows[rs][1] == cols[cs][1]}


def level_product(level: int) -> int:
    """The product holding ``level``'s pairs: 0 for levels 3 and 2, 1 for levels 1 and 0."""
    return 0 if level >= 2 else 1


def level_anchor(token: int, level: int) -> int:
    """Token ``token``'s anchor at ``level``: ``((token >> level) | 1) << level``; the token is a row of it (anchor
    ``<= token``) when bit ``level`` of the token is set, else a column (anchor ``> token``)."""
    return ((token >> level) | 1) << level


def level_slots() -> tuple[tuple[int, ...], ...]:
    """Per level 0..3, the slot of each token 0..15 in :func:`level_product`'s row slots (bit ``level`` of the
    token set) or column slots (clear): the inverse of :func:`diag_products`'s tables."""
    tables = diag_products()
    slots = []
    for level in range(LEVELS):
        rows, cols = tables[level_product(level)]
        per_token = []
        for token in range(DIAG_SIZE):
            side = rows if token >> level & 1 else cols
            per_token.append(side.index((token, level_anchor(token, level))))
        slots.append(tuple(per_token))
    return tuple(slots)


def pack_nibbles(values) -> tuple[int, int]:
    """16 values in 0..15 as two 32-bit words (slots 0-7, 8-15; 4 bits per slot, slot 0 lowest): the device reads
    slot ``s`` as ``(word >> 4 (s % 8)) & 15``."""
    values = list(values)
    if len(values) != DIAG_SIZE or not all(0 <= v < DIAG_SIZE for v in values):
        raise ValueError(f"expected {DIAG_SIZE} values in 0..{DIAG_SIZE - 1}, got {values}")
    return tuple(sum(v << (4 * s) for s, v in enumerate(values[h * 8:(h + 1) * 8])) for h in range(2))
