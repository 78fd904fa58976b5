"""The recommended DiLoCo outer learning rate by participants M and inner steps H (issue #21).

DiLoCo's outer step is Nesterov SGD with momentum 0.9. Its best learning rate is not one number:
docs/quality.md (the `tokens20` study) measured it by M and H, and `outer_defaults` takes an
unset `outer.lr` of DiLoCo from this table. The measured points are M = 2 and M = 4, and
H = 10, 30 and 100; a run between them takes the nearest measured point, and an M between the
rows the row of smaller learning rates (too small costs a little loss; too large, at small H,
diverges):

- M: 3 or fewer take the M = 2 row, 4 or more the M = 4 row. M = 1 (one participant) was not
  measured; it takes the M = 2 row, which lies at or below Charles et al.'s best for M = 1 and 2.
- H: below 18 takes the H = 10 column, 18 to 54 the H = 30 column, 55 and above H = 100.
  (18 and 55 are the geometric midpoints of the measured H, rounded up.)
"""

from __future__ import annotations

#: outer lr by M row, then by H column (see docs/quality.md, "The recommended outer learning rate").
RECOMMENDED: dict[int, dict[int, float]] = {
    2: {10: 0.4, 30: 0.4, 100: 0.7},
    4: {10: 0.4, 30: 0.85, 100: 1.0},
}

#: The first H of the H = 30 and H = 100 columns.
H_EDGES = (18, 55)


def recommended_outer_lr(participants: int, sync_every: int) -> float:
    """DiLoCo's recommended outer lr for `participants` (M) merged per round and `sync_every` (H)
    inner steps between syncs: the table's nearest measured point (module docstring)."""
    if participants < 1 or sync_every < 1:
        raise ValueError(f"M and H must be at least 1, not M={participants}, H={sync_every}")
    row = RECOMMENDED[2 if participants <= 3 else 4]
    column = 10 if sync_every < H_EDGES[0] else 30 if sync_every < H_EDGES[1] else 100
    return row[column]


def describe() -> str:
    """The table in words, for the config reference (`outer.lr`)."""
    (h1, h2), low, high = H_EDGES, RECOMMENDED[2], RECOMMENDED[4]

    def cell(h: int) -> str:
        return f"{low[h]}" if low[h] == high[h] else f"{low[h]} (M <= 3) or {high[h]} (M >= 4)"

    return f"{cell(10)} at H < {h1}, {cell(30)} at H {h1}-{h2 - 1}, {cell(100)} at H >= {h2}"
