"""``distaccum plan``: predict step time, communication share and peak memory of every split of a
global batch, from a few measured windows per micro-batch size, and recommend one.

For G samples per step on W ranks the splits are the divisors m of G/W (K = G/(W m)). A step is a
per-step part plus K micro-batches. For each micro-batch size m a short trial of the real training
loop (the public :class:`~distaccum.trainer.Trainer`, the same code a run executes) at split
(m, K_t = min(K, trial_accum), W) measures both:

    step(m, K) = base(m) + (K - K_t) * micro(m)

    base(m)      median time_s of the trial's steps (K_t micro-batches, the boundary reduction, the
                 optimizer step)
    micro(m)     median over the trial's steps of one micro-batch before the boundary: fetching,
                 collating and forward/backward of a micro-batch that does not reduce
                 ((time_s - optim_s - last_micro_s) / (K_t - 1); with K_t = 1, (data_s + compute_s))
    comm share   exposed / (K * compute + exposed), medians of comm_exposed_s and compute_s / K_t, as
                 ``summary.json``'s ``comm_share``

Splits with K <= trial_accum are measured as they are; larger K are extrapolated. Medians, because a
shared machine stalls single steps (another process, a garbage collection) by many times their
length; the median step time is what the plan predicts (:func:`typical_step_s`). Summing the phases'
medians instead would be wrong: compute and exposed communication trade off between ranks (one rank
computing late makes the other wait), and on a loaded machine that sum was 12% short of the median step.

Peak memory does not depend on K (the accumulated gradient is one buffer): each size's peak comes from a
trial window (:mod:`distaccum.tuning.autobatch`), measured in ascending order before any timing, so on CPU
no other model is resident. Sizes whose extrapolated peak exceeds the budget are not tried, and
neither is anything larger than a size that did not fit. The timing trials of several sizes run
interleaved, a few steps each per round with the order rotated, so drift of a shared machine falls on
all sizes alike; on CUDA they run one after another (each trial's model must leave the device first).
The recommendation is the fastest predicted split that fits.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch
import torch.distributed as dist

from distaccum.components import Components
from distaccum.config import RunConfig, Split, check_split, valid_splits, with_overrides
from distaccum.resolve import resolve
from distaccum.telemetry.sinks import Record
from distaccum.trainer import Trainer
from distaccum.tuning.autobatch import (
    Measurement,
    TrialMeasure,
    default_budget,
    memory_kind,
    micro_batch_sizes,
)
from distaccum.units import human_bytes

TRIAL_ACCUM = 4
"""Default accumulation steps of a timing trial (K_t = min(K, TRIAL_ACCUM))."""


@dataclass
class SizeCost:
    """The measured coefficients of one micro-batch size (medians over the trial's steady steps)."""

    micro_batch: int
    trial_accum: int
    steps: int
    """Steady trial steps behind the medians."""
    base_s: float
    """Step time at K = trial_accum."""
    micro_s: float
    """One more micro-batch: data + forward/backward of a micro-batch that does not reduce (measured on the
    trial's micro-batches before its last; with K_t = 1, the one micro-batch)."""
    compute_s: float
    """One micro-batch's forward/backward (micro_s without the data time)."""
    boundary_s: float
    """Exposed communication of the boundary reduction (once per step)."""
    optim_s: float

    def step_s(self, accum_steps: int) -> float:
        """Predicted seconds per optimizer step at K = ``accum_steps``."""
        return self.base_s + (accum_steps - self.trial_accum) * self.micro_s

    def comm_share(self, accum_steps: int) -> float:
        """Predicted exposed communication / (compute + exposed communication)."""
        busy = accum_steps * self.compute_s + self.boundary_s
        return self.boundary_s / busy if busy > 0 else 0.0


@dataclass
class Prediction:
    """One row of the plan."""

    split: Split
    step_s: float | None
    """None when the size was not timed (it does not fit)."""
    comm_share: float | None
    peak_bytes: int
    peak_measured: bool
    """False: extrapolated from smaller sizes (a size predicted not to fit is never run)."""
    fits: bool


@dataclass
class SplitPlan:
    """Everything ``distaccum plan`` prints and writes to ``plan.json``."""

    global_batch: int
    world_size: int
    budget_bytes: int
    memory: str
    predictions: list[Prediction]
    costs: list[SizeCost] = field(default_factory=list)
    recommended: Split | None = None

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (``plan.json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SplitPlan:
        """Inverse of :meth:`as_dict`."""
        preds = [Prediction(**{**p, "split": Split(**p["split"])}) for p in data["predictions"]]
        rec = data.get("recommended")
        return cls(
            data["global_batch"],
            data["world_size"],
            data["budget_bytes"],
            data["memory"],
            preds,
            [SizeCost(**c) for c in data.get("costs", [])],
            Split(**rec) if rec else None,
        )


def steady_steps(records: Sequence[Record], warmup: int = 1) -> list[Record]:
    """The steps a plan's times describe: after ``warmup``, full windows only."""
    return [r for r in records[warmup:] if not r.get("partial_window")] or list(records)


def typical_step_s(records: Sequence[Record], warmup: int = 1) -> float:
    """What the plan predicts for a run: the median step time over :func:`steady_steps`."""
    return median(r["time_s"] for r in steady_steps(records, warmup))


def non_boundary_micro_s(record: Record, accum_steps: int) -> float:
    """What one micro-batch before the boundary took in a step of ``accum_steps``: the boundary micro-batch
    also launches and waits for the reduction (DDP's bucket hooks), so averaging it in would overstate
    every micro-batch added by a larger K (by 20% at K = 16 from a K = 2 trial, measured:
    tests/test_planner_accuracy.py)."""
    if accum_steps > 1 and "last_micro_s" in record:
        return (record["time_s"] - record["optim_s"] - record["last_micro_s"]) / (accum_steps - 1)
    return (record["data_s"] + record["compute_s"]) / accum_steps


def size_cost(records: Sequence[Record], micro_batch: int, trial_accum: int, warmup: int = 1) -> SizeCost:
    """Coefficients from a trial's records (``cost.step_s(trial_accum) == typical_step_s(records)``)."""
    steady = steady_steps(records, warmup)

    def med(fn: Callable[[Record], float]) -> float:
        return median(fn(r) for r in steady)

    return SizeCost(
        micro_batch,
        trial_accum,
        len(steady),
        base_s=typical_step_s(records, warmup),
        micro_s=med(lambda r: non_boundary_micro_s(r, trial_accum)),
        compute_s=med(lambda r: r["compute_s"] / trial_accum),
        boundary_s=med(lambda r: r["comm_exposed_s"]),
        optim_s=med(lambda r: r["optim_s"]),
    )


def predict(
    global_batch: int, world_size: int, costs: Sequence[SizeCost], probes: Sequence[Measurement]
) -> list[Prediction]:
    """One prediction per valid split (ascending micro-batch)."""
    by_size = {c.micro_batch: c for c in costs}
    by_probe = {p.micro_batch: p for p in probes}
    rows = []
    for split in valid_splits(global_batch, world_size):
        cost, probe = by_size.get(split.micro_batch), by_probe[split.micro_batch]
        rows.append(
            Prediction(
                split,
                cost.step_s(split.accum_steps) if cost else None,
                cost.comm_share(split.accum_steps) if cost else None,
                probe.peak_bytes,
                probe.measured,
                probe.fits,
            )
        )
    return rows


def recommend(predictions: Sequence[Prediction]) -> Split | None:
    """The fastest predicted split that fits (None when none fits)."""
    timed = [p for p in predictions if p.fits and p.step_s is not None]
    return min(timed, key=lambda p: p.step_s or 0.0).split if timed else None


class SizeTrial:
    """Timing trial of one micro-batch size: a Trainer at split (m, K_t) in its own run directory,
    run a few steps at a time (so trials of several sizes can interleave)."""

    def __init__(
        self,
        cfg: RunConfig,
        parts: Components,
        micro_batch: int,
        trial_accum: int,
        max_steps: int,
        run_dir: Path,
    ) -> None:
        self.micro_batch, self.trial_accum = micro_batch, trial_accum
        trial_cfg = with_overrides(
            cfg,
            {
                "accum.micro_batch": micro_batch,
                "accum.steps": trial_accum,
                "accum.global_batch": None,
                "accum.ramp": {},  # a trial times one split: no batch growth
                "accum.adaptive": {},
                "trainer.max_steps": max_steps,
                "trainer.resume": False,
                "trainer.save_final": False,
                "trainer.check_every": 0,
                "log.console": "quiet",
                "log.wandb": False,
                "log.ledger": True,
                "log.gns": False,
                "log.warmup_steps": 1,
                "run_dir": str(run_dir),
            },
        )
        self.trainer = Trainer.of(trial_cfg, parts, check_components=False)
        self.records: list[Record] = []
        self.console = io.StringIO()
        """The trial's console output (its sinks print the run summary): kept off the plan's table."""

    def run(self, steps: int) -> None:
        """``steps`` more optimizer steps (the first call also builds the model and engine)."""
        with contextlib.redirect_stdout(self.console):  # the console sink is built on the first call
            self.records += self.trainer.train_steps(steps)

    def close(self) -> None:
        """Finish the trial (writes its summary.json) and release its engine. Collective."""
        with contextlib.redirect_stdout(self.console):
            self.trainer.finish()

    def cost(self) -> SizeCost:
        """The coefficients measured so far."""
        return size_cost(self.records, self.micro_batch, self.trial_accum)


def interleave(runners: Sequence[Callable[[int], None]], rounds: int, steps: int) -> None:
    """Call every runner with ``steps`` each round, for ``rounds`` rounds, rotating the order by one
    each round (every rank calls them in the same order: they are collective)."""
    for r in range(rounds):
        for i in range(len(runners)):
            runners[(i + r) % len(runners)](steps)


def probe_sizes(
    sizes: Sequence[int], measure: Callable[[int], Measurement], budget: int
) -> list[Measurement]:
    """Measure each size in ascending order; stop measuring at the first that does not fit, or when
    the peak extrapolated linearly from the last two sizes exceeds ``budget`` (the rest are marked
    with that extrapolation, or the failed size's peak, and do not fit)."""
    probes: list[Measurement] = []
    for m in sizes:
        fitted = [p for p in probes if p.fits]
        if probes and not probes[-1].fits:
            probes.append(Measurement(m, probes[-1].peak_bytes, False, measured=False))
            continue
        if len(fitted) >= 2:
            (m0, p0), (m1, p1) = [(p.micro_batch, p.peak_bytes) for p in fitted[-2:]]
            guess = int(p1 + max((p1 - p0) / (m1 - m0), 0.0) * (m - m1))
            if guess > budget:
                probes.append(Measurement(m, guess, False, measured=False))
                continue
        probes.append(measure(m))
    return probes


class SplitPlanner:
    """The measurements behind a :class:`SplitPlan`, in three steps so that a caller can interleave its own
    work with the timing rounds (the prediction test times the real splits in the same rounds):
    construction probes the memory of every size and creates the timing trials of those that fit;
    :attr:`runners` are the trials' ``run(steps)``; :meth:`finish` closes them and predicts. Collective."""

    def __init__(
        self,
        cfg: RunConfig,
        parts: Components,
        device: torch.device,
        local_world_size: int,
        run_dir: Path,
        *,
        max_steps: int,
        trial_accum: int = TRIAL_ACCUM,
    ) -> None:
        world = dist.get_world_size()
        check_split(cfg.accum, world)
        self.device, self.world = device, world
        self.global_batch = cfg.global_batch(world)
        budget = cfg.accum.budget_bytes() or default_budget(device, local_world_size)
        self.measure = TrialMeasure(resolve(cfg, world, device, rank=dist.get_rank()), parts, budget)
        self.probes = probe_sizes(
            micro_batch_sizes(self.global_batch, world), self.measure, self.measure.budget
        )
        per_rank = self.global_batch // world
        self.trials = [
            SizeTrial(
                cfg,
                parts,
                p.micro_batch,
                min(per_rank // p.micro_batch, trial_accum),
                max_steps,
                run_dir / "trials" / f"m{p.micro_batch}",
            )
            for p in self.probes
            if p.fits
        ]

    @property
    def runners(self) -> list[Callable[[int], None]]:
        """``run(steps)`` of every timing trial."""
        return [t.run for t in self.trials]

    def finish(self) -> SplitPlan:
        """Close the trials and predict every split."""
        for trial in self.trials:
            trial.close()
        costs = [t.cost() for t in self.trials]
        predictions = predict(self.global_batch, self.world, costs, self.probes)
        return SplitPlan(
            self.global_batch,
            self.world,
            self.measure.budget,
            memory_kind(self.device),
            predictions,
            costs,
            recommend(predictions),
        )


def plan_splits(
    cfg: RunConfig,
    parts: Components,
    device: torch.device,
    local_world_size: int,
    run_dir: Path,
    *,
    rounds: int = 5,
    steps: int = 2,
    trial_accum: int = TRIAL_ACCUM,
    interleaved: bool | None = None,
) -> SplitPlan:
    """Measure and predict every split of ``cfg``'s global batch on the current process group
    (collective): one warm-up step per size, then ``rounds`` x ``steps`` timed steps, interleaved
    (default on CPU) or one size after another. Trial run directories go under ``run_dir/trials``."""
    planner = SplitPlanner(
        cfg, parts, device, local_world_size, run_dir, max_steps=1 + rounds * steps, trial_accum=trial_accum
    )
    if interleaved if interleaved is not None else device.type == "cpu":
        interleave(planner.runners, 1, 1)  # warm-up step of every size
        interleave(planner.runners, rounds, steps)
    else:
        for run in planner.runners:
            run(1 + rounds * steps)
    return planner.finish()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"


def render_table(plan: SplitPlan) -> str:
    """The plan as a markdown table plus the recommendation line."""
    lines = [
        "| split | micro-batch | K | predicted step | predicted comm share | predicted peak memory | fits |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in plan.predictions:
        mark = " <- recommended" if plan.recommended == p.split else ""
        peak = (
            human_bytes(p.peak_bytes) if p.peak_measured else f"~{human_bytes(p.peak_bytes)} (extrapolated)"
        )
        share = "-" if p.comm_share is None else f"{p.comm_share:.0%}"
        lines.append(
            f"| {p.split.label()} | {p.split.micro_batch} | {p.split.accum_steps} | {_ms(p.step_s)} | "
            f"{share} | {peak} | {'yes' if p.fits else 'no'}{mark} |"
        )
    return "\n".join(lines)
