"""Do the ranks agree? Each rank sends a small row of float64 numbers, one all-gather hands every rank every row, and
the rows are compared: the ranks whose numbers differ are named.

Whatever must come out the same on every rank is compared here: the reduction fingerprint's rows
(:mod:`~distaccum.guards.fingerprint`: ranks grouped by equal rows, NaN equal to NaN, since a non-finite step is alike
everywhere; the sharded checksum's verdicts arrive in the same rows), the adaptive batch's decision
(:mod:`distaccum.batching.adaptive`) and the outer sync's merged parameters (:mod:`distaccum.outer.sync`). The last
two are compared with the first rank's bit for bit (:func:`require`): the same numbers computed the same way are
the same bits. Every rank holds every row, so every rank finds the same disagreement and stops at the same step,
with the caller's own error naming the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from distaccum.runtime.procgroup import gather_rows

gather = gather_rows
"""Every rank's row of a few numbers, (ranks, n) float64 on the host (:func:`~distaccum.runtime.procgroup.gather_rows`,
the one all-gather of small rows)."""


def differing(rows: torch.Tensor) -> list[int]:
    """The ranks whose row of float64 ``rows`` differs from the first rank's, bit for bit (a NaN equals the same NaN;
    0.0 and -0.0 differ)."""
    bits = rows.contiguous().view(torch.int64)
    return [rank for rank in range(1, len(bits)) if not torch.equal(bits[rank], bits[0])]


def require(
    values: torch.Tensor | Sequence[float],
    fail: Callable[[list[list[float]], list[int]], Exception],
    *,
    group: Any = None,
    device: torch.device | None = None,
) -> list[list[float]]:
    """Gather ``values`` from every rank of ``group`` (:func:`gather`) and compare them with the first rank's, bit for
    bit; when some rank's differ, raise ``fail(rows, ranks)`` (every rank's numbers, the ranks that differ), on every
    rank alike. Returns the rows. Collective."""
    table = gather(values, group=group, device=device)
    odd = differing(table)
    rows = table.tolist()
    if odd:
        raise fail(rows, odd)
    return rows


def same(a: float, b: float) -> bool:
    """Bitwise-style equality of two gathered numbers (NaN equals NaN: a non-finite step is alike everywhere)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def all_same(rows: list[list[float]]) -> bool:
    """Whether every row equals the first (:func:`same` numbers): the common verdict, without grouping the ranks."""
    first = rows[0]
    return all(row == first or all(same(x, y) for x, y in zip(first, row, strict=True)) for row in rows[1:])


def groups(rows: list[list[float]]) -> list[list[int]]:
    """Ranks grouped by equal rows (:func:`same` numbers), the largest group first (ties: the group of the lowest
    rank)."""
    found: list[list[int]] = []
    for rank, row in enumerate(rows):
        for group in found:
            if all(same(x, y) for x, y in zip(rows[group[0]], row, strict=True)):
                group.append(rank)
                break
        else:
            found.append([rank])
    return sorted(found, key=lambda g: (-len(g), g[0]))
