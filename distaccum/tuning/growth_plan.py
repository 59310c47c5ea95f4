"""``distaccum plan`` for a growing batch: each phase's K and its predicted step time (pure).

The planner measures the cost of every micro-batch size (:class:`~distaccum.tuning.planner.SizeCost`: a step of K
micro-batches takes ``base_s + (K - K_t) micro_s``). A ramp keeps the micro-batch and changes K, so each phase's
step time follows from the same coefficients: the phase's split (:func:`~distaccum.batching.growth.phase_split`),
its predicted step, samples per second, and the phase's time up to ``trainer.max_steps``. For the adaptive batch the
phases are not known in advance: the rows are its smallest and largest batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from distaccum.batching.growth import BatchGrowth, phase_split
from distaccum.split import Split
from distaccum.tuning.planner import SizeCost


@dataclass(frozen=True)
class PhaseRow:
    """One phase of the batch growth with its prediction."""

    first: int
    """1-based first step."""
    last: int
    """1-based last step (``max_steps`` at most)."""
    split: Split
    step_s: float | None
    """None: the phase's micro-batch size was not measured."""

    @property
    def steps(self) -> int:
        return self.last - self.first + 1

    @property
    def phase_s(self) -> float | None:
        return None if self.step_s is None else self.step_s * self.steps

    @property
    def samples_per_s(self) -> float | None:
        return None if not self.step_s else self.split.global_batch / self.step_s


def phase_rows(
    batches: Sequence[tuple[int, int]],
    costs: Sequence[SizeCost],
    micro_batch: int,
    world_size: int,
    max_steps: int,
) -> list[PhaseRow]:
    """One row per ``(first 0-based step, global batch)`` of ``batches`` that starts before ``max_steps``."""
    by_size = {c.micro_batch: c for c in costs}
    rows = []
    for i, (first, batch) in enumerate(batches):
        if first >= max_steps:
            break
        last = min(batches[i + 1][0] if i + 1 < len(batches) else max_steps, max_steps)
        split = phase_split(batch, micro_batch, world_size)
        cost = by_size.get(split.micro_batch)
        rows.append(
            PhaseRow(first + 1, last, split, None if cost is None else cost.step_s(split.accum_steps))
        )
    return rows


def _ms(seconds: float | None) -> str:
    return "not measured" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _duration(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.1f} s"


def render_phases(
    growth: BatchGrowth,
    costs: Sequence[SizeCost],
    micro_batch: int,
    world_size: int,
    max_steps: int,
    adaptive_bounds: tuple[int, int] | None = None,
) -> str:
    """The growth's section of ``distaccum plan``'s output: a table of phases (or of the adaptive batch's
    bounds) with K and the predicted step time, and the whole run's predicted time."""
    if adaptive_bounds is not None:
        lo, hi = adaptive_bounds
        rows = [
            PhaseRow(0, 0, phase_split(b, micro_batch, world_size), None)
            for b in sorted({lo, growth.phases[0][1], hi})
        ]
        by_size = {c.micro_batch: c for c in costs}
        rows = [
            PhaseRow(0, 0, r.split, by_size[r.split.micro_batch].step_s(r.split.accum_steps))
            if r.split.micro_batch in by_size
            else r
            for r in rows
        ]
        lines = [
            f"adaptive batch (accum.adaptive): from {growth.phases[0][1]} within [{lo}, {hi}]; its phases are chosen "
            f"as it runs, so here its start and bounds, micro-batch {micro_batch} on {world_size} ranks:",
            "",
            "| global batch | split | predicted step | samples/s |",
            "|---|---|---|---|",
        ]
        for r in rows:
            rate = "-" if r.samples_per_s is None else f"{r.samples_per_s:.0f}"
            lines.append(
                f"| {r.split.global_batch} | {r.split.label()} (K={r.split.accum_steps}) | {_ms(r.step_s)} | {rate} |"
            )
        return "\n".join(lines)
    rows = phase_rows(growth.phases, costs, micro_batch, world_size, max_steps)
    lines = [
        f"batch ramp (accum.ramp): K per phase, micro-batch {micro_batch} on {world_size} ranks, step times from the "
        "coefficients measured above:",
        "",
        "| steps | global batch | split | predicted step | samples/s | phase |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rate = "-" if r.samples_per_s is None else f"{r.samples_per_s:.0f}"
        phase = "-" if r.phase_s is None else _duration(r.phase_s)
        lines.append(
            f"| {r.first}-{r.last} | {r.split.global_batch} | {r.split.label()} (K={r.split.accum_steps}) | "
            f"{_ms(r.step_s)} | {rate} | {phase} |"
        )
    times = [r.phase_s for r in rows]
    if rows and all(t is not None for t in times):
        total = sum(t for t in times if t is not None)
        samples = sum(r.split.global_batch * r.steps for r in rows)
        lines += [
            "",
            f"whole ramp, {max_steps} steps, {samples:,} samples: predicted {_duration(total)} of steps",
        ]
    return "\n".join(lines)
