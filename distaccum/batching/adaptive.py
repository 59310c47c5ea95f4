"""The adaptive global batch: every N steps the next global batch follows the measured gradient noise scale.

McCandlish et al. (2018): the batch beyond which larger batches stop buying proportionally fewer steps is about the
noise scale; the simple estimate B_simple = tr(Sigma) / |G|^2 is what ``log.gns`` measures from every step
(:mod:`distaccum.telemetry.gns`), smoothed as ``gns_smoothed``. The rule (:func:`next_batch`), evaluated after step
s when s >= ``accum.adaptive.warmup`` and s is a multiple of ``accum.adaptive.every``:

    target = gns_smoothed / (items / samples of step s)        (the estimate counts loss items; the batch, samples)
    target = clamp(target, G / max_factor, G x max_factor)     (G: the current global batch)
    G'     = unit x max(1, floor(target / unit + 1/2))           (unit = micro_batch x world: a whole K)
    G'     = clamp(G', min_batch, max_batch)                     (rounded onto multiples of unit)

A negative or undefined smoothed estimate (|G|^2's average below zero, early in training or when the per-step
estimates are mostly noise) keeps G, and the record says so (``adaptive_target`` NaN). Every rank evaluates the
rule on the same numbers (the all-reduced noise-scale terms and the window's item count, reduced in float64), so
the ranks agree by construction; that is checked at each decision: one all-gather of three float64 numbers per
rank, compared bit for bit (:mod:`distaccum.guards.agreement`), and a disagreement stops the run naming the ranks.
The change takes effect from step s + 1 (the data order cuts its window at the new size, K follows, the learning
rate follows ``optim.lr_scaling``); the phases chosen travel in the checkpoint with the data order, the averages in
the records, so a resumed run makes the same decisions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distaccum.batching.config import AdaptiveConfig
from distaccum.batching.growth import BatchGrowth
from distaccum.guards import agreement
from distaccum.window import WindowResult

VERIFY_RECIPE = (
    "accum.adaptive chooses its global batches as it runs, so the reference cannot know them in advance: verify "
    "the batches an adaptive run chose as a ramp, with its summary.json's batch_phases [[step, global_batch], ...] "
    "as the ramp's points and the last phase's global batch as the run's: the same overrides plus "
    "accum.adaptive.enabled=false 'accum.ramp.points=BATCH_PHASES' accum.global_batch=LAST_GLOBAL_BATCH"
)
"""``distaccum verify``'s refusal of an adaptive run, with the recipe that verifies its batches
(tests/test_batch_growth.py runs the recipe's overrides through the config's checks)."""


class AdaptiveDisagreement(RuntimeError):
    """The ranks computed different global batches from what must be the same numbers."""


@dataclass(frozen=True)
class Decision:
    """One evaluation of the rule."""

    noise_scale: float
    """gns_smoothed, in loss items."""
    target: float
    """The target in samples before rounding (NaN when the estimate was not usable)."""
    batch: int
    """The global batch from the next step on."""

    def row(self) -> list[float]:
        return [self.noise_scale, self.target, float(self.batch)]


def next_batch(
    current: int,
    noise_scale: float,
    items_per_sample: float,
    cfg: AdaptiveConfig,
    unit: int,
    lo: int,
    hi: int,
) -> Decision:
    """The rule of the module docstring: the next global batch from the smoothed noise scale (loss items)."""
    if not (math.isfinite(noise_scale) and noise_scale > 0 and items_per_sample > 0):
        return Decision(noise_scale, math.nan, current)
    target = noise_scale / items_per_sample
    bounded = min(max(target, current / cfg.max_factor), current * cfg.max_factor)
    batch = unit * max(1, math.floor(bounded / unit + 0.5))
    return Decision(noise_scale, target, min(max(batch, lo), hi))


class AdaptiveBatch:
    """``accum.adaptive``: a :class:`~distaccum.loop.StepMonitor` after the noise-scale monitor (whose smoothed
    estimate of the step it reads as soon as the step ends), changing ``growth`` (shared with the data order) at its
    decision steps; ``on_change(first step, global batch)`` makes the learning rate follow."""

    def __init__(
        self,
        cfg: AdaptiveConfig,
        growth: BatchGrowth,
        gns: Any,
        samples_of: Callable[[int], int],
        on_change: Callable[[int, int], None],
        *,
        unit: int,
        global_batch: int,
        max_steps: int,
        rank: int,
        world_size: int,
        device: torch.device,
        group: Any = None,
    ) -> None:
        self.cfg, self.growth, self.gns, self.on_change = cfg, growth, gns, on_change
        self.samples_of = samples_of
        """The samples of a 0-based step's window (the data order's: a last window may be partial)."""
        self.unit, (self.lo, self.hi) = unit, cfg.bounds(unit, global_batch)
        self.rank, self.world, self.device, self.group = rank, world_size, device, group
        self.max_steps = max_steps
        self._decided: dict[int, Decision] = {}

    def due(self, step: int) -> bool:
        """Whether the rule runs after 1-based step ``step`` (not after the last: no step would follow)."""
        return step >= self.cfg.warmup and step % self.cfg.every == 0 and step < self.max_steps

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None:
        if not self.due(step):
            return
        smoothed = self.gns.latest(step)["gns_smoothed"]
        current = self.growth.global_batch(step - 1)
        per_sample = window.items / max(self.samples_of(step - 1), 1)
        decision = next_batch(current, smoothed, per_sample, self.cfg, self.unit, self.lo, self.hi)
        self._agree(step, decision)
        self._decided[step] = decision
        if self.growth.change(step, decision.batch):  # 0-based ``step`` is the next one
            self.on_change(step, decision.batch)

    def _agree(self, step: int, decision: Decision) -> None:
        """All ranks must have decided the same, bit for bit (one all-gather of three float64 numbers)."""

        def disagreement(rows: list[list[float]], odd: list[int]) -> AdaptiveDisagreement:
            return AdaptiveDisagreement(
                f"accum.adaptive after step {step}: rank(s) {', '.join(map(str, odd))} computed another global batch "
                f"than rank 0 from what must be the same reduced numbers (rank 0: noise scale {rows[0][0]:.17g}, "
                f"target {rows[0][1]:.17g}, batch {rows[0][2]:.0f}; rank {odd[0]}: {rows[odd[0]][0]:.17g}, "
                f"{rows[odd[0]][1]:.17g}, {rows[odd[0]][2]:.0f}). The run stops: its ranks would train different "
                "windows."
            )

        agreement.require(decision.row(), disagreement, group=self.group, device=self.device)

    def fields(self, record: dict[str, Any], times: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
        decision = self._decided.pop(int(record["step"]), None)
        if decision is None:
            return {}
        return {
            "adaptive_noise_scale": decision.noise_scale,
            "adaptive_target": decision.target,
            "adaptive_next_batch": decision.batch,
        }
