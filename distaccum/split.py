"""Splits of a global batch: ``global_batch = micro_batch x accum_steps x world_size`` (a leaf module)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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
    return (
        f"accum.global_batch={global_batch} has no split on world_size={world_size} ranks: it must be a "
        f"multiple of world_size={world_size}; the nearest valid global batches are {near}"
    )


class Accumulation(Protocol):
    """What a split is resolved from (``accum.*``: :class:`distaccum.config.AccumConfig`)."""

    micro_batch: int | str
    steps: int
    global_batch: int | None

    @property
    def auto(self) -> bool: ...


def _world(world_size: int) -> None:
    if world_size <= 0:
        raise ValueError(f"trainer.world_size must be > 0, got {world_size!r}")


def check_split(accum: Accumulation, world_size: int) -> None:
    """Raise ValueError (with the valid alternatives) when ``accum`` has no split on ``world_size``
    ranks. With micro_batch=auto only the global batch can be checked before training starts."""
    if accum.auto:
        assert accum.global_batch is not None  # AccumConfig guarantees it
        _world(world_size)
        if accum.global_batch % world_size:
            raise ValueError(no_split_message(accum.global_batch, world_size))
        return
    resolve_split(accum, world_size)


def check_worlds(accum: Accumulation, worlds: Sequence[int], where: str) -> None:
    """Raise ValueError naming every world size in ``worlds`` (those an elastic launch, ``where``, may run on) on
    which ``accum`` has no split, with the nearest global batches that split on all of them."""
    bad = []
    for world in worlds:
        try:
            check_split(accum, world)
        except ValueError:
            bad.append(world)
    if bad:
        micro = 1 if accum.auto else int(accum.micro_batch)
        unit = math.lcm(*worlds) * micro
        near = " or ".join(str(g) for g in nearest_valid_global_batches(accum.global_batch or 0, unit))
        rule = (
            "it must be a multiple of each"
            if accum.auto
            else f"accum.micro_batch={micro} x accumulation steps x world size must equal it on each"
        )
        raise ValueError(
            f"{where} may run on world sizes {', '.join(map(str, worlds))}, and accum.global_batch="
            f"{accum.global_batch} has no split on {', '.join(map(str, bad))} ({rule}); the nearest global "
            f"batches that split on all of them are {near}"
        )


def resolve_split(accum: Accumulation, world_size: int) -> Split:
    """Resolve the configured split for ``world_size`` ranks, or raise ValueError with suggestions.

    micro_batch=auto cannot be resolved here: the Trainer measures and picks it at setup."""
    _world(world_size)
    if accum.auto:
        raise ValueError(
            "accum.micro_batch=auto is chosen when training starts (Trainer.setup measures "
            "it); give an explicit accum.micro_batch here (`distaccum plan` suggests one)"
        )
    assert isinstance(accum.micro_batch, int)
    if accum.global_batch is None:
        return Split(accum.micro_batch, accum.steps, world_size)
    if accum.global_batch % world_size:
        raise ValueError(no_split_message(accum.global_batch, world_size))
    per_step = accum.micro_batch * world_size
    if accum.global_batch % per_step:
        options = valid_splits(accum.global_batch, world_size)
        hint = ", ".join(f"micro_batch={s.micro_batch} (steps={s.accum_steps})" for s in options)
        raise ValueError(
            f"accum.global_batch={accum.global_batch} is not divisible by accum.micro_batch={accum.micro_batch}"
            f" x world_size={world_size} = {per_step}. Valid splits for world_size={world_size}: {hint}."
        )
    return Split(accum.micro_batch, accum.global_batch // per_step, world_size)
