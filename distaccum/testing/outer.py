"""The bug zoo's outer-sync bugs: mistakes peers shipped in DiLoCo's merge, each a fault that wraps the real
:class:`~distaccum.outer.sync.OuterSync` (interception point ``outer``).

The outer step calls its own ``contribution`` and ``weight`` from ``merge_if_due``, so a wrapper object would not see
those calls: each fault replaces the one method on the real instance (as :class:`~distaccum.testing.faults.
SkipReduction` replaces the engine's comm hook) and leaves everything else, the all-reduce included, as it is.
Every island gets the same fault, so the islands still agree on the merged parameters (the islands' agreement check
stays quiet): only ``distaccum verify``'s simulator can tell.
"""

from __future__ import annotations

from typing import Any

import torch


def diloco_sync(point: str, obj: Any, what: str) -> bool:
    """True for the outer step of a diloco run (the fault applies); ValueError for another outer method."""
    if point != "outer":
        return False
    if obj.cfg.method != "diloco":
        raise ValueError(f"{what} needs outer.method=diloco, this run has outer.method={obj.cfg.method}")
    return True


class PseudoGradientSignFlipped:
    """DiLoCo's pseudo-gradient with the wrong sign (torchft #233, seen as torchtitan #1507): each island sends
    local - global instead of global - local (theta_g - theta_i, how far it moved). The outer SGD descends along
    the merged pseudo-gradient, so the global parameters step away from where the islands trained them."""

    def wrap(self, point: str, obj: Any) -> Any:
        if not diloco_sync(point, obj, "PseudoGradientSignFlipped"):
            return obj

        def flipped(p: int) -> list[torch.Tensor]:
            return [obj.local[i] - obj.global_params[i] for i in obj.fragments[p]]

        obj.contribution = flipped
        return obj


class SumAsMean:
    """The islands' all-reduced SUM used as their mean (torchft #286: a reduction's scaling by the participant
    count, which only a mean gets): each island scales its pseudo-gradient for a mean over the islands (by its
    items against the average island's, n_i R / sum_j n_j: 1 with equal counts) and the all-reduce SUMs them
    without the division by R that a mean needs. The merged pseudo-gradient, and the outer step, are R times
    too large."""

    def wrap(self, point: str, obj: Any) -> Any:
        if not diloco_sync(point, obj, "SumAsMean"):
            return obj
        weight = obj.weight

        def undivided(counts: list[float]) -> float:
            return weight(counts) * len(counts)

        obj.weight = undivided
        return obj
