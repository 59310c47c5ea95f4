"""``distaccum plan``: predict step time, communication share and peak memory of every split of a
global batch, from a few measured windows per micro-batch size, and recommend one.

For G samples per step on W ranks the splits are the divisors m of G/W (K = G/(W m)). The model of
one optimizer step is linear in K, and its coefficients are measured per micro-batch size m by a
short trial of the real training loop (the public :class:`~distaccum.trainer.Trainer`, the same code
a run executes) at split (m, K_t = min(K, trial_accum), W):

    step(m, K) = K * micro(m) + boundary(m) + optim(m)

    micro(m)     mean over the trial's steps of (data_s + compute_s) / K_t: fetching, collating and
                 the forward/backward of one micro-batch (per micro-batch, whatever K)
    boundary(m)  mean comm_exposed_s: the boundary reduction's exposed time (once per step)
    optim(m)     mean optim_s: item-count all-reduce, normalize, clip, optimizer step (once per step)

Means, not medians: the record's phases add up to ``time_s``, and only means add (the sum of the
phases' medians is not the median step; on a loaded machine it was 12% short). Steps are the
steady ones without the fastest and slowest 10% (:func:`steady_steps`); the plan predicts that
trimmed mean step time (:func:`typical_step_s`) for each split.

    comm share   boundary / (K * compute + boundary), as ``summary.json``'s ``comm_share``

Splits with K <= trial_accum are therefore measured as they are; larger K are extrapolated. Peak
memory does not depend on K (the accumulated gradient is one buffer): each size's peak comes from a
trial window (:mod:`distaccum.autobatch`), measured in ascending order before any timing, so on CPU
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
from statistics import mean
from typing import Any

import torch
import torch.distributed as dist

from distaccum.autobatch import Probe, auto_trial, default_budget, memory_kind, micro_batch_sizes
from distaccum.components import Components
from distaccum.config import RunConfig, Split, check_split, valid_splits, with_overrides
from distaccum.sinks import Record, human_bytes
from distaccum.trainer import Trainer

TRIAL_ACCUM = 4
"""Default accumulation steps of a timing trial (K_t = min(K, TRIAL_ACCUM))."""
TRIM = 0.1
"""Share of the fastest and of the slowest steps left out of a plan's means."""


@dataclass
class SizeCost:
    """The measured coefficients of one micro-batch size."""

    micro_batch: int
    trial_accum: int
    steps: int
    """Steady trial steps behind the medians."""
    micro_s: float
    compute_s: float
    """Median forward/backward time of one micro-batch (micro_s without the data time)."""
    boundary_s: float
    optim_s: float

    def step_s(self, accum_steps: int) -> float:
        """Predicted seconds per optimizer step at K = ``accum_steps``."""
        return accum_steps * self.micro_s + self.boundary_s + self.optim_s

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
class Plan:
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
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        """Inverse of :meth:`as_dict`."""
        preds = [Prediction(**{**p, "split": Split(**p["split"])}) for p in data["predictions"]]
        rec = data.get("recommended")
        return cls(data["global_batch"], data["world_size"], data["budget_bytes"], data["memory"], preds,
                   [SizeCost(**c) for c in data.get("costs", [])], Split(**rec) if rec else None)


def steady_steps(records: Sequence[Record], warmup: int = 1, trim: float = TRIM) -> list[Record]:
    """The steps a plan's times describe: after ``warmup``, full windows only, without the fastest and
    the slowest ``trim`` share of steps (by ``time_s``: a step stalled by another process)."""
    steady = sorted((r for r in records[warmup:] if not r.get("partial_window")), key=lambda r: r["time_s"])
    cut = int(len(steady) * trim)
    return steady[cut:len(steady) - cut] or steady


def typical_step_s(records: Sequence[Record], warmup: int = 1) -> float:
    """What the plan predicts for a run: the mean step time over :func:`steady_steps` (the mean, not
    the median, because the model adds times: the mean of a sum is the sum of the means)."""
    return mean(r["time_s"] for r in steady_steps(records, warmup))


def size_cost(records: Sequence[Record], micro_batch: int, trial_accum: int, warmup: int = 1) -> SizeCost:
    """Coefficients from a trial's records: means over :func:`steady_steps`, so that
    ``cost.step_s(trial_accum) == typical_step_s(records)``."""
    steady = steady_steps(records, warmup)

    def avg(fn: Callable[[Record], float]) -> float:
        return mean(fn(r) for r in steady)

    return SizeCost(micro_batch, trial_accum, len(steady),
                    micro_s=avg(lambda r: (r["data_s"] + r["compute_s"]) / trial_accum),
                    compute_s=avg(lambda r: r["compute_s"] / trial_accum),
                    boundary_s=avg(lambda r: r["comm_exposed_s"]), optim_s=avg(lambda r: r["optim_s"]))


def predict(global_batch: int, world_size: int, costs: Sequence[SizeCost], probes: Sequence[Probe]) -> list[Prediction]:
    """One prediction per valid split (ascending micro-batch)."""
    by_size = {c.micro_batch: c for c in costs}
    by_probe = {p.micro_batch: p for p in probes}
    rows = []
    for split in valid_splits(global_batch, world_size):
        cost, probe = by_size.get(split.micro_batch), by_probe[split.micro_batch]
        rows.append(Prediction(split, cost.step_s(split.accum_steps) if cost else None,
                               cost.comm_share(split.accum_steps) if cost else None,
                               probe.peak_bytes, probe.measured, probe.fits))
    return rows


def recommend(predictions: Sequence[Prediction]) -> Split | None:
    """The fastest predicted split that fits (None when none fits)."""
    timed = [p for p in predictions if p.fits and p.step_s is not None]
    return min(timed, key=lambda p: p.step_s or 0.0).split if timed else None


class SizeTrial:
    """Timing trial of one micro-batch size: a Trainer at split (m, K_t) in its own run directory,
    run a few steps at a time (so trials of several sizes can interleave)."""

    def __init__(self, cfg: RunConfig, parts: Components, micro_batch: int, trial_accum: int, max_steps: int,
                 run_dir: Path) -> None:
        self.micro_batch, self.trial_accum = micro_batch, trial_accum
        trial_cfg = with_overrides(cfg, {
            "accum.micro_batch": micro_batch, "accum.steps": trial_accum, "accum.global_batch": None,
            "trainer.max_steps": max_steps, "trainer.resume": False, "trainer.save_final": False,
            "trainer.check_every": 0, "log.console": "quiet", "log.wandb": False, "log.ledger": True,
            "log.gns": False, "log.warmup_steps": 1, "run_dir": str(run_dir)})
        self.trainer = Trainer(trial_cfg, model=parts.model, dataset=parts.dataset, loss=parts.loss,
                               collate=parts.collate, optimizer=parts.optimizer, check_components=False,
                               names=parts.names)
        self.records: list[Record] = []

    def run(self, steps: int) -> None:
        """``steps`` more optimizer steps (the first call also builds the model and engine)."""
        self.records += self.trainer.train_steps(steps)

    def close(self) -> None:
        """Finish the trial (writes its summary.json; its console summary is not printed) and release
        its engine. Collective."""
        with contextlib.redirect_stdout(io.StringIO()):
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


def probe_sizes(sizes: Sequence[int], measure: Callable[[int], Probe], budget: int) -> list[Probe]:
    """Measure each size in ascending order; stop measuring at the first that does not fit, or when
    the peak extrapolated linearly from the last two sizes exceeds ``budget`` (the rest are marked
    with that extrapolation, or the failed size's peak, and do not fit)."""
    probes: list[Probe] = []
    for m in sizes:
        fitted = [p for p in probes if p.fits]
        if probes and not probes[-1].fits:
            probes.append(Probe(m, probes[-1].peak_bytes, False, measured=False))
            continue
        if len(fitted) >= 2:
            (m0, p0), (m1, p1) = [(p.micro_batch, p.peak_bytes) for p in fitted[-2:]]
            guess = int(p1 + max((p1 - p0) / (m1 - m0), 0.0) * (m - m1))
            if guess > budget:
                probes.append(Probe(m, guess, False, measured=False))
                continue
        probes.append(measure(m))
    return probes


class SplitPlanner:
    """The measurements behind a :class:`Plan`, in three steps so that a caller can interleave its own
    work with the timing rounds (the prediction test times the real splits in the same rounds):
    construction probes the memory of every size and creates the timing trials of those that fit;
    :attr:`runners` are the trials' ``run(steps)``; :meth:`finish` closes them and predicts. Collective."""

    def __init__(self, cfg: RunConfig, parts: Components, device: torch.device, local_world_size: int,
                 run_dir: Path, *, max_steps: int, trial_accum: int = TRIAL_ACCUM) -> None:
        world = dist.get_world_size()
        check_split(cfg.accum, world)
        self.device, self.world = device, world
        self.global_batch = cfg.global_batch(world)
        self.measure = auto_trial(cfg, parts, device, cfg.accum.budget_bytes() or default_budget(device, local_world_size))
        self.probes = probe_sizes(micro_batch_sizes(self.global_batch, world), self.measure, self.measure.budget)
        per_rank = self.global_batch // world
        self.trials = [SizeTrial(cfg, parts, p.micro_batch, min(per_rank // p.micro_batch, trial_accum), max_steps,
                                 run_dir / "trials" / f"m{p.micro_batch}") for p in self.probes if p.fits]

    @property
    def runners(self) -> list[Callable[[int], None]]:
        """``run(steps)`` of every timing trial."""
        return [t.run for t in self.trials]

    def finish(self) -> Plan:
        """Close the trials and predict every split."""
        for trial in self.trials:
            trial.close()
        costs = [t.cost() for t in self.trials]
        predictions = predict(self.global_batch, self.world, costs, self.probes)
        return Plan(self.global_batch, self.world, self.measure.budget, memory_kind(self.device), predictions, costs,
                    recommend(predictions))


def plan_splits(cfg: RunConfig, parts: Components, device: torch.device, local_world_size: int, run_dir: Path, *,
                rounds: int = 5, steps: int = 2, trial_accum: int = TRIAL_ACCUM,
                interleaved: bool | None = None) -> Plan:
    """Measure and predict every split of ``cfg``'s global batch on the current process group
    (collective): one warm-up step per size, then ``rounds`` x ``steps`` timed steps, interleaved
    (default on CPU) or one size after another. Trial run directories go under ``run_dir/trials``."""
    planner = SplitPlanner(cfg, parts, device, local_world_size, run_dir, max_steps=1 + rounds * steps,
                           trial_accum=trial_accum)
    if interleaved if interleaved is not None else device.type == "cpu":
        interleave(planner.runners, 1, 1)  # warm-up step of every size
        interleave(planner.runners, rounds, steps)
    else:
        for run in planner.runners:
            run(1 + rounds * steps)
    return planner.finish()


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1e3:.1f} ms"


def render_table(plan: Plan) -> str:
    """The plan as a markdown table plus the recommendation line."""
    lines = ["| split | micro-batch | K | predicted step | predicted comm share | predicted peak memory | fits |",
             "|---|---|---|---|---|---|---|"]
    for p in plan.predictions:
        mark = " <- recommended" if plan.recommended == p.split else ""
        peak = human_bytes(p.peak_bytes) if p.peak_measured else f"~{human_bytes(p.peak_bytes)} (extrapolated)"
        share = "-" if p.comm_share is None else f"{p.comm_share:.0%}"
        lines.append(f"| {p.split.label()} | {p.split.micro_batch} | {p.split.accum_steps} | {_ms(p.step_s)} | "
                     f"{share} | {peak} | {'yes' if p.fits else 'no'}{mark} |")
    return "\n".join(lines)
