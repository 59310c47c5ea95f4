"""Splits of a global batch: ``global_batch = micro_batch x accum_steps x world_size`` (a leaf module)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Split:
    """A resolved split: global_batch = micro_batch * accum_steps * world_size."""

    micro_batch: int
    accum_steps: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum_steps * self.world_size

    def label(self) -> str:
        """``w2-m4-k4``: world size, micro-batch, accumulation steps."""
        return f"w{self.world_size}-m{self.micro_batch}-k{self.accum_steps}"


def valid_splits(global_batch: int, world_size: int) -> list[Split]:
    """Every (micro_batch, steps) that yields ``global_batch`` on ``world_size`` ranks."""
    if global_batch % world_size:
        return []
    per_rank = global_batch // world_size
    return [Split(m, per_rank // m, world_size) for m in range(1, per_rank + 1) if per_rank % m == 0]


def nearest_valid_global_batches(global_batch: int, world_size: int) -> list[int]:
    """The multiples of ``world_size`` nearest to ``global_batch`` (one below, one above)."""
    below = global_batch // world_size * world_size
    return [g for g in (below, below + world_size) if g > 0]


def no_split_message(global_batch: int, world_size: int) -> str:
    near = " or ".join(str(g) for g in nearest_valid_global_batches(global_batch, world_size))
    return (f"accum.global_batch={global_batch} has no split on world_size={world_size} ranks: it must be a "
            f"multiple of world_size={world_size}; the nearest valid global batches are {near}")
