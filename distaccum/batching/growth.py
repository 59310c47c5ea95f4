"""The global batch per optimizer step: constant, a ramp, or what the adaptive rule chose so far.

A :class:`BatchGrowth` is a list of phases ``(first step, global batch)`` (0-based steps): step s takes the
batch of the last phase starting at or before it. The data order (:class:`~distaccum.data.global_batch.
GlobalBatchOrder`) cuts each step's window of that many samples from the same sample stream an unramped run
reads, so a ramp never skips or repeats a sample. The split of a step keeps the configured micro-batch and
changes K, the accumulated micro-batches: K = G / (micro_batch x world). Only when K alone cannot reach G (G /
world is no multiple of the micro-batch) the micro-batch drops to the largest divisor of G / world below it, and
the start of the run says so.

The learning rate follows ``optim.lr_scaling`` per phase (:func:`lr_scales`): lr x f(G_s / optim.base_batch);
with ``optim.lr_scaling=none`` it stays as configured.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from distaccum.batching.config import AdaptiveConfig, RampConfig
from distaccum.config import OptimConfig
from distaccum.split import Split


def phase_split(global_batch: int, micro_batch: int, world_size: int) -> Split:
    """The split of a phase: K = G / (micro_batch x world), or, when G / world is no multiple of ``micro_batch``, the
    largest micro-batch below it that divides G / world. Raises ValueError when G is no multiple of the world."""
    if global_batch % world_size:
        raise ValueError(
            f"a global batch of {global_batch} samples has no split on {world_size} ranks: every phase of the "
            f"batch growth must be a multiple of the world size"
        )
    per_rank = global_batch // world_size
    micro = next(m for m in range(min(micro_batch, per_rank), 0, -1) if per_rank % m == 0)
    return Split(micro, per_rank // micro, world_size)


def megatron_phases(start: int, increment: int, samples: int, final: int) -> list[tuple[int, int]]:
    """Megatron-LM's ``--rampup-batch-size START INCR SAMPLES`` as phases: before a step that follows ``consumed``
    samples the batch is ``start + increment x floor(consumed / (samples / n))`` (n = (final - start) / increment
    increments), ``final`` once it is reached."""
    if final <= start or (final - start) % increment:
        raise ValueError(
            f"accum.ramp: accum.global_batch={final} must exceed accum.ramp.start={start} by a multiple of "
            f"accum.ramp.increment={increment}"
        )
    per_increment = samples / ((final - start) // increment)
    phases, consumed, step, batch = [(0, start)], 0, 0, start
    while batch < final:  # per phase, not per step: a long ramp has millions of steps
        grown = int(consumed / per_increment) + 1  # the increments counted once the batch next grows
        steps = max(1, math.ceil((grown * per_increment - consumed) / batch))
        while steps > 1 and int((consumed + (steps - 1) * batch) / per_increment) >= grown:
            steps -= 1  # the estimate's rounding, corrected against the rule itself
        while int((consumed + steps * batch) / per_increment) < grown:
            steps += 1
        consumed, step = consumed + steps * batch, step + steps
        batch = min(start + increment * int(consumed / per_increment), final)
        phases.append((step, batch))
    return phases


class BatchGrowth:
    """The global batch of every optimizer step: phases ``(first 0-based step, global batch)``, the first at step 0.

    ``version`` counts appended phases (the adaptive rule's changes), so a data source can tell that the windows it
    prefetched were cut for another batch."""

    def __init__(self, phases: Sequence[tuple[int, int]]) -> None:
        if not phases or phases[0][0] != 0:
            raise ValueError(f"a growing batch starts at step 0, got {list(phases)!r}")
        self.phases: list[tuple[int, int]] = []
        self.version = 0
        for first, batch in phases:
            self._add(int(first), int(batch))

    def _add(self, first: int, batch: int) -> None:
        if batch <= 0:
            raise ValueError(f"a global batch must be positive, got {batch}")
        if self.phases and first <= self.phases[-1][0]:
            raise ValueError(f"phase at step {first} does not follow the one at step {self.phases[-1][0]}")
        if self.phases and batch == self.phases[-1][1]:
            return  # no change
        self.phases.append((first, batch))

    @classmethod
    def constant(cls, global_batch: int) -> BatchGrowth:
        return cls([(0, global_batch)])

    @classmethod
    def of(cls, ramp: RampConfig, global_batch: int) -> BatchGrowth:
        """The growth ``accum.ramp`` describes, ending at ``global_batch`` (constant without a ramp)."""
        if ramp.points is not None:
            if ramp.points[-1][1] != global_batch:
                raise ValueError(
                    f"accum.ramp.points end at a global batch of {ramp.points[-1][1]}, accum.global_batch is "
                    f"{global_batch}: the ramp ends at accum.global_batch"
                )
            return cls([(step - 1, batch) for step, batch in ramp.points])
        if ramp.start is not None:
            assert ramp.increment is not None and ramp.samples is not None  # RampConfig checks
            return cls(megatron_phases(ramp.start, ramp.increment, ramp.samples, global_batch))
        return cls.constant(global_batch)

    @property
    def varies(self) -> bool:
        """Whether the global batch changes at all (so far)."""
        return len(self.phases) > 1

    @property
    def largest(self) -> int:
        return max(batch for _, batch in self.phases)

    def global_batch(self, step: int) -> int:
        """The global batch of 0-based optimizer step ``step``."""
        if len(self.phases) == 1:
            return self.phases[0][1]
        return self.phases[bisect.bisect_right(self.phases, (step, float("inf"))) - 1][1]

    def change(self, first: int, batch: int) -> bool:
        """From 0-based step ``first`` on, ``batch`` samples per step (the adaptive rule); whether it changed."""
        before = len(self.phases)
        self._add(first, batch)
        changed = len(self.phases) != before
        self.version += changed
        return changed

    def check(self, world_sizes: Sequence[int], micro_batch: int | None) -> None:
        """Raise ValueError naming the phases that have no split on one of ``world_sizes``."""
        for world in world_sizes:
            bad = [f"{batch} (from step {first + 1})" for first, batch in self.phases if batch % world]
            if bad:
                raise ValueError(
                    f"the global batch growth has no split on {world} ranks: {', '.join(bad)} "
                    f"{'is' if len(bad) == 1 else 'are'} no multiple of {world}; every phase must be a multiple of "
                    "the world size"
                )
            if micro_batch is not None:
                for _, batch in self.phases:
                    phase_split(batch, micro_batch, world)

    def describe(self, micro_batch: int, world_size: int, max_steps: int) -> list[str]:
        """One line per phase up to ``max_steps``: steps, global batch, its split (a lowered micro-batch said)."""
        lines = []
        for i, (first, batch) in enumerate(self.phases):
            if first >= max_steps:
                break
            last = min(self.phases[i + 1][0] if i + 1 < len(self.phases) else max_steps, max_steps)
            split = phase_split(batch, micro_batch, world_size)
            lowered = (
                f" (micro-batch lowered from {micro_batch}: {batch // world_size} samples per rank is no "
                f"multiple of it)"
                if split.micro_batch != micro_batch
                else ""
            )
            lines.append(
                f"steps {first + 1}-{last}: global batch {batch} = micro-batch {split.micro_batch} x K={split.accum_steps}"
                f" x {world_size} ranks{lowered}"
            )
        return lines

    def state_dict(self) -> dict[str, Any]:
        return {"phases": [list(p) for p in self.phases]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Adopt the phases a checkpoint recorded (an adaptive run's decisions so far)."""
        phases = [(int(a), int(b)) for a, b in state["phases"]]
        if phases != self.phases:
            self.phases = phases
            self.version += 1


def lr_scales(growth: BatchGrowth, scale: Callable[[int], float]) -> list[list[float]]:
    """``[[first step, lr multiplier], ...]`` of each phase (``optim.lr_scaling`` applied to its global batch)."""
    return [[first, scale(batch)] for first, batch in growth.phases]


def describe_growth(
    growth: BatchGrowth,
    split: Split,
    max_steps: int,
    optim: OptimConfig,
    adaptive: AdaptiveConfig | None = None,
) -> str:
    """What rank 0 prints at the start of a run whose batch grows (``adaptive``: the rule's settings, when it
    decides): each
    phase's split, and what the learning rate does."""
    world = split.world_size
    phases = ["  " + line for line in growth.describe(split.micro_batch, world, max_steps)]
    if adaptive is not None:
        unit = split.micro_batch * world
        lo, hi = adaptive.bounds(unit, growth.phases[0][1])
        head = (
            f"distaccum: adaptive global batch (accum.adaptive): starts at {growth.phases[0][1]}; after every "
            f"{adaptive.every} steps from step {adaptive.warmup} the smoothed noise scale (gns_smoothed, in loss items, "
            f"over the step's items per sample) "
            f"chooses the next one, a multiple of micro-batch x world = {unit} (a whole K) within [{lo}, {hi}], at most "
            f"x{adaptive.max_factor:g} per change"
        )
    else:
        head = "distaccum: global batch ramp (accum.ramp), K follows it at optimizer-step boundaries:"
    lines = [head, *phases]
    reached = [batch for first, batch in growth.phases if first < max_steps]
    if adaptive is not None and max_steps <= adaptive.warmup:
        lines.append(
            f"  warning: trainer.max_steps={max_steps} ends before accum.adaptive.warmup={adaptive.warmup}: the rule "
            f"never decides, every step takes {growth.phases[0][1]} samples"
        )
    elif adaptive is None and reached[-1] != growth.phases[-1][1]:
        lines.append(
            f"  warning: the ramp does not reach its end within trainer.max_steps={max_steps}: the run ends at a "
            f"global batch of {reached[-1]}, not {growth.phases[-1][1]} (accum.global_batch)"
        )
    if optim.lr_scaling == "none":
        lines.append(
            f"  lr stays as configured at every global batch: {optim.lr:.4g} (optim.lr_scaling=none)"
        )
    else:
        shown = ", ".join(f"{optim.lr * optim.lr_scale(b):.4g} at {b}" for _, b in growth.phases[:6])
        lines.append(
            f"  lr follows optim.lr_scaling={optim.lr_scaling} (optim.base_batch {optim.base_batch}): {shown}"
            + (", ..." if len(growth.phases) > 6 else "")
        )
    return "\n".join(lines)


def growth_summary(
    growth: BatchGrowth, records: Sequence[Mapping[str, Any]], world_size: int
) -> dict[str, Any]:
    """summary.json's fields of a run whose batch grows, from what it ran: the phases its steps reached
    (``batch_phases``,
    1-based first steps: what ``accum.ramp.points`` takes), and the split of its last step (``global_batch``,
    ``accum_steps``, ``micro_batch``), which is not the configured end of a ramp cut short by ``max_steps``."""
    steps = len(records)
    out: dict[str, Any] = {
        "batch_phases": [[first + 1, batch] for first, batch in growth.phases if first < steps]
    }
    if records:
        last = records[-1]
        batch, k = int(last["global_batch"]), int(last["micro_steps"])
        out.update(global_batch=batch, accum_steps=k, micro_batch=batch // (k * world_size))
    return out
