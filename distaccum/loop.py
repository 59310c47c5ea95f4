"""The accumulation loop: K micro-batches per rank, one gradient reduction, one optimizer step.

The math, for one optimizer step (a *window*). Rank r's micro-batch k has summed loss S_rk over n_rk loss items;
N = sum_rk n_rk is the window's global item count. The gradient we want is the full-batch one:

    grad L = sum_rk grad S_rk / N

N is only known once every micro-batch's forward has run (the loss reports n_rk; a streaming source cannot count
ahead), so each micro-batch backpropagates

    S_rk * c * d        d = engine.grad_divisor (undoes whatever the engine divides by itself)
                        c = 2^-round(log2 N_prev), the same power of two on every rank

and the engine reduces the accumulated sum_rk c grad S_rk once, at the boundary. Before the last backward ONE
collective gives every rank N (:class:`~distaccum.window.WindowTotals`, with the loss sum and the stop and
checkpoint votes); the last backward overlaps it. The engine's step then multiplies the reduced gradient by
``grad_scale`` = 1/(c N), clipping in the same multiply (:meth:`~distaccum.engines.base.Engine.step`): the one
normalization, on every engine. c keeps gradients at the scale of a mean (what fp16 loss scaling expects); being a
power of two, multiplying by it is exact in floating point, so it never changes a bit of the result: a resumed run,
whatever its N_prev, matches an uninterrupted one. Partial windows need nothing special: N counts what the window
holds, never K x micro_batch.

:func:`train_step` is that math and nothing else. :func:`train` runs it step after step and hands each step to the
components that own the rest (:class:`LoopParts`): the timer (which times the window source, not the step), the
reduction fingerprint, per-step monitors (tripwire, straggler view, noise scale), the non-finite policy, the
checkpointer and the records.

Host work per step, counted (``tests/test_host_ops.py``): beyond what the expert hand-written ``no_sync`` loop does,
no operator per micro-batch (the loss's multiply replaces its division) and a few per step (the window's row and
collective, the gradient norm, the fingerprint's sample, the one multiply). On CUDA the host waits for the device
twice per step: for the window's rows after the last backward was queued, and for the gradient norm (only the first
without a norm: no clipping, ``log.grad_norm=false``); fp16 adds GradScaler's three reads.

With ``accum.exact=true`` the engine sums the micro-batches' gradients in int64 fixed point (:mod:`distaccum.exact`);
a step whose gradients outgrew the fixed-point scale applies nothing and says so (``StepResult.redo``), and
:func:`run_step` runs the same window again, on every rank alike (the one retry loop: fault-tolerant replica groups'
extends it to a step whose reduction across groups failed).

``accum.loss_norm=mean_per_micro`` is the classic loss/K (each micro-batch's mean divided by K x W) and is wrong
whenever micro-batches hold different numbers of items; it is kept only as a negative control that
``distaccum verify`` must catch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from distaccum.data.pipeline import WindowBatches, WindowSource
from distaccum.engines.base import Engine, StepResult
from distaccum.guards.fingerprint import Fingerprint
from distaccum.losses import LossFn
from distaccum.runtime.stopping import StopFlag, StopRequested
from distaccum.split import Split
from distaccum.telemetry.sinks import Record, Sink
from distaccum.telemetry.summary import run_samples
from distaccum.telemetry.timing import PendingTimes, StepTimer, StepTimes
from distaccum.window import WindowResult, WindowTotals


@dataclass
class TrainState:
    """Everything the loop mutates, kept together so a checkpoint can save and restore it."""

    model: nn.Module
    """The wrapped module the loss calls."""
    engine: Engine
    scheduler: torch.optim.lr_scheduler.LRScheduler
    source: WindowSource
    """Where windows come from (its position is checkpointed)."""
    records: list[Record] = field(default_factory=list)
    n_prev: float = 0.0
    """The previous window's global item count (sets the power-of-two c; 0: none yet)."""
    nonfinite_streak: int = 0
    """Consecutive steps skipped for non-finite values (checkpointed)."""
    outer: Any = None
    """An outer-synced run's :class:`~distaccum.outer.sync.OuterSync` (checkpointed with the rest); None."""


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs besides its state and parts, resolved once (:func:`distaccum.resolve.resolve`)."""

    split: Split
    max_steps: int
    max_samples: int | None
    """``trainer.max_samples``: the run ends after the step whose samples bring the total to it or past it."""
    clip_norm: float | None
    every_micro: bool
    """Reduce after every micro-batch (``accum.sync=every_micro``) instead of only at the boundary."""
    loss_norm: str
    float_dtype: torch.dtype | None
    """Cast floating batch tensors to this dtype (fp64 runs); None leaves them."""
    device: torch.device
    rank: int


def power_of_two_scale(n_prev: float, global_batch: int) -> float:
    """c = 2^-round(log2 N_prev) (the global batch before the first window): exact to multiply by."""
    reference = n_prev if n_prev > 0 else float(global_batch)
    return 2.0 ** -round(math.log2(max(reference, 1.0)))


def loss_multiplier(
    settings: LoopSettings, split: Split, c: float, d: float, weight: float, n_items: Any
) -> Any:
    """What a micro-batch's summed loss is multiplied by before its backward: c d times its weight (0 for a stand-in
    sample). The classic loss/K (``accum.loss_norm=mean_per_micro``, the negative control) divides by the
    micro-batch's own item count and the step's K x W too."""
    if settings.loss_norm == "global_count":
        return c * d * weight
    n = n_items.clamp(min=1.0) if isinstance(n_items, torch.Tensor) else max(float(n_items), 1.0)
    return c * d * weight / (n * split.accum_steps * split.world_size)


@dataclass(frozen=True)
class Step:
    """What :func:`train_step` did: the window, its totals over every rank, the engine's step."""

    window: WindowBatches
    totals: WindowResult
    result: StepResult
    lr: float
    """The learning rate the step used."""
    c: float
    d: float

    @property
    def number(self) -> int:
        """The 1-based optimizer step."""
        return self.window.step + 1


def train_step(
    state: TrainState,
    settings: LoopSettings,
    loss_fn: LossFn,
    totals: WindowTotals,
    votes: Callable[[], dict[str, Any]],
) -> Step:
    """One optimizer step, the step math: fetch this rank's window, K micro-steps accumulating gradients locally, the
    window's one collective (N) launched before the last backward, then one reduction, x 1/(c N), clip, step.
    ``votes()`` gives what rides on the collective (stop and checkpoint votes, a check's row). Collective."""
    engine = state.engine
    window = state.source.window()  # 1. fetch: this rank's K micro-batches, on the device
    split = window.split  # K of this step (a growing batch changes it between steps, never inside one)
    c, d = power_of_two_scale(state.n_prev, split.global_batch), engine.grad_divisor
    totals.start()
    for k, micro in enumerate(window.micro):  # 2. K micro-steps
        last = k == split.accum_steps - 1
        with engine.sync(last or settings.every_micro):  # no_sync off the boundary
            with engine.forward_context():
                summed, n_items = loss_fn(state.model, micro.batch)
            weight = totals.add(summed, n_items, micro.samples)
            if last:  # N's collective, before the last backward: the backward overlaps it
                totals.reduce(**votes())
            engine.backward(summed * loss_multiplier(settings, split, c, d, weight, n_items))  # S_rk c d
        del micro, summed  # one micro-batch's inputs alive at a time
    lr = float(state.scheduler.get_last_lr()[0])
    window_totals = totals.read()  # 3. the one reduction is done; N over every rank
    result = engine.step(
        settings.clip_norm, window_totals.grad_scale(c, settings.loss_norm)
    )  # 4. x 1/(c N), clip
    if result.redo:  # accum.exact: a piece outgrew the fixed-point scale; run_step runs it again
        return Step(window, window_totals, result, lr, c, d)
    if result.applied:  # a skipped step does not advance the schedule; never per micro-batch
        state.scheduler.step()
    state.source.advance()
    state.n_prev = window_totals.items
    return Step(window, window_totals, result, lr, c, d)


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


class OuterStep(Protocol):
    """The outer step of an outer-synced run (:class:`~distaccum.outer.sync.OuterSync`): after every optimizer step,
    a merge across the islands at its sync steps, where the islands' votes are agreed (between syncs each island's
    window collective stays inside it, so its votes are its own)."""

    def merge_if_due(self, step: int, items: float, stop: bool, checkpoint: bool) -> tuple[bool, bool]: ...

    def fields(self) -> Record:
        """The last step's record fields (what crossed between the islands)."""
        ...


class StepMonitor(Protocol):
    """Observes each optimizer step; owns its own cadence. ``after_step`` runs before the step's timing
    ends (it may issue collectives: every rank calls it); ``fields`` adds record fields afterwards."""

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None: ...

    def fields(self, record: Record, times: StepTimes, records: list[Record]) -> Record: ...


class NonFinitePolicy:
    """Non-finite steps are skipped on every rank alike; after ``max_steps`` in a row the run stops.
    fp16 GradScaler overflow skips (``loss_scaling``) are routine and do not count."""

    def __init__(self, max_steps: int, loss_scaling: bool) -> None:
        self.max_steps, self.loss_scaling = max_steps, loss_scaling

    def observe(self, state: TrainState, totals: WindowResult, result: StepResult) -> bool:
        """Whether this step counts as non-finite (updates the streak)."""
        nonfinite = bool(totals.bad_ranks) or (not result.applied and not self.loss_scaling)
        state.nonfinite_streak = state.nonfinite_streak + 1 if nonfinite else 0
        return nonfinite

    def exhausted(self, state: TrainState) -> bool:
        """Whether :meth:`enforce` raises after this step."""
        return state.nonfinite_streak >= self.max_steps

    def enforce(self, state: TrainState, step: int, totals: WindowResult, result: StepResult) -> None:
        """Raise :class:`NonFiniteError` with a diagnosis once the streak reaches ``max_steps``."""
        if not self.exhausted(state):
            return
        ranks = totals.bad_ranks
        raise NonFiniteError(
            f"{state.nonfinite_streak} consecutive optimizer steps (up to step {step}) had non-finite "
            f"values and were skipped on every rank (trainer.max_nonfinite_steps={self.max_steps}). At step "
            f"{step}: "
            + (
                f"the loss was non-finite on rank(s) {', '.join(map(str, ranks))}; "
                if ranks
                else "the loss was finite but the gradient was not; "
            )
            + f"first parameter with a non-finite gradient on rank 0: {result.nonfinite_param or 'n/a'}. "
            "Parameters are those of the last finite step; no checkpoint holds a non-finite value. Lower the "
            "learning rate or check the data of these steps."
        )


class StepRetry(Protocol):
    """Runs one optimizer step until it counts: ``attempt(totals)`` is :func:`train_step` with the window's totals
    ``totals`` stands for (a wrapper may extend their collective), called again while the step did not count (a
    redo, ``StepResult.redo``, included: :func:`until_summed` is the default)."""

    def __call__(self, attempt: Callable[[Any], Step], totals: WindowTotals) -> Step: ...


class CheckpointPolicy(Protocol):
    """When to checkpoint, and the writing (:class:`distaccum.rundir.checkpoint.Checkpointer`)."""

    def due_by_time(self) -> bool: ...

    def saves_after(self, step: int, *, due: bool, stopping: bool) -> bool: ...

    def save(self, state: TrainState) -> Path: ...


@dataclass
class LoopParts:
    """The components the loop hands each step to, and the window's totals it steps with."""

    timer: StepTimer
    sink: Sink
    nonfinite: NonFinitePolicy
    totals: WindowTotals
    checkpointer: CheckpointPolicy | None = None
    monitors: list[StepMonitor] = field(default_factory=list)
    fingerprint: Fingerprint | None = None
    """The reduction fingerprint (``trainer.fingerprint``): its row rides on the next window's collective."""
    stop: StopFlag | None = None
    on_step: Callable[[TrainState, Record], None] | None = None
    lag: bool = False
    """Hand step n's record to the sinks and ``on_step`` once step n+1 is queued (:class:`StepEnd`)."""
    flush_after: Callable[[int], bool] | None = None
    """Steps whose record must be handed over before the next step starts, under ``lag`` (an evaluation's)."""
    outer: OuterStep | None = None
    """An outer-synced run's outer step (``outer.method``), run right after each optimizer step."""
    retry: StepRetry | None = None
    """Runs each step until it counts (fault-tolerant replica groups, ``ft.groups``: a step whose reduction across
    groups failed is computed again); None: every step counts once run."""

    def flushes(self, step: int) -> bool:
        """Whether step ``step``'s record must be published before the next step starts (an evaluation's)."""
        return self.flush_after is not None and self.flush_after(step)

    def votes(self) -> dict[str, Any]:
        """What this rank sends with the window's collective: a stop request, a checkpoint due by time, the
        fingerprint's pending row."""
        return {
            "stop": self.stop is not None and self.stop.requested,
            "checkpoint": self.checkpointer is not None and self.checkpointer.due_by_time(),
            "carry": self.fingerprint.carry() if self.fingerprint is not None else None,
        }


@dataclass
class StepEnd:
    """A step whose work is queued, and what its record needs. With ``LoopParts.lag`` (CUDA) the loop hands the
    record over one step late: step n's CUDA timings are resolved once step n+1's work is queued, so the host never
    drains the device's queue to time a step. A step that checkpoints, stops, ends the call, reaches the non-finite
    limit or is named by ``LoopParts.flush_after`` is handed over at once, so checkpoints, evaluations and the
    records a call returns are exactly the step's. ``on_step`` then runs with the model one step further than its
    record. A run that fails during step n+1 loses step n's record (never a checkpointed step's)."""

    step: Step
    times: PendingTimes
    nonfinite: bool
    extra: Record = field(default_factory=dict)
    """Fields known when the step ended (the outer sync's)."""
    island: bool = False
    """The window's collective spans one island of several (an outer-synced run): the record adds the run's."""

    def publish(self, state: TrainState, parts: LoopParts) -> None:
        """Resolve the step's timings (waiting for its own events only), then record, log and call ``on_step``."""
        times = self.times.resolve()
        record = step_record(self.step, times, self.nonfinite, self.island)
        record.update(self.extra)  # nothing unless the run is outer-synced
        for monitor in parts.monitors:
            record.update(monitor.fields(record, times, state.records))
        state.records.append(record)
        parts.sink.log(record)
        if parts.on_step is not None:
            parts.on_step(state, record)


def step_record(step: Step, times: StepTimes, nonfinite: bool, island: bool = False) -> Record:
    """The step's ``metrics.jsonl`` line (identical on every rank but the timings). Its samples, items, loss and
    reductions are those of the ranks the window's collective spans: the run, or in an outer-synced run (``island``)
    rank 0's island, and then ``run_samples``/``run_samples_per_s`` add the step of every island (the data order's
    window; the islands' items are not known before they meet at a sync)."""
    window, totals, result, n = step.window, step.totals, step.result, step.totals.items
    samples = totals.samples
    timed = times.as_record()  # time_s, data_s, compute_s, optim_s, comm_*, peak_mem_bytes
    run = (
        {"run_samples": window.samples, "run_samples_per_s": window.samples / times.time_s} if island else {}
    )
    return {
        "step": step.number,
        "epoch": window.epoch,
        "loss": totals.loss_sum / n if n else float("nan"),
        "lr": step.lr,
        "samples": samples,
        "items": round(n),
        "global_batch": window.split.global_batch,
        "micro_steps": window.split.accum_steps,
        "partial_window": window.partial,
        "grad_norm": result.grad_norm,
        "skipped": not result.applied,
        "nonfinite": nonfinite,
        **timed,
        "comm_bytes_per_sample": (timed.get("comm_bytes", 0) + timed.get("comm_bytes_replicate", 0))
        / max(samples, 1),
        "micro_items_min": round(totals.items_min),
        "micro_items_max": round(totals.items_max),
        "samples_per_s": samples / times.time_s,
        "items_per_s": n / times.time_s,
        **run,
    }


def until_summed(attempt: Callable[[Any], Step], totals: WindowTotals) -> Step:
    """The default :class:`StepRetry`: a step runs again only while its engine asks for a redo (``accum.exact``: a
    piece outgrew the fixed-point scale, which is now wider; the same window, the same pieces)."""
    while True:
        done = attempt(totals)
        if not done.result.redo:
            return done


def run_step(state: TrainState, settings: LoopSettings, loss_fn: LossFn, parts: LoopParts) -> Step:
    """:func:`train_step` until it counts: again after a redo (:func:`until_summed`), and with ``parts.retry``
    (replica groups) again when its reduction across groups failed, under the next quorum."""
    retry = parts.retry if parts.retry is not None else until_summed
    return retry(lambda totals: train_step(state, settings, loss_fn, totals, parts.votes), parts.totals)


def train(
    state: TrainState, settings: LoopSettings, loss_fn: LossFn, parts: LoopParts, *, until: int | None = None
) -> list[Record]:
    """Run optimizer steps until step ``until`` (default ``settings.max_steps``) or ``settings.max_samples``; returns
    the records of the steps run by this call (identical on every rank; ``state.records`` holds them all).

    Each step is :func:`train_step`; around it the components that own the rest take their turn: the fingerprint
    and the monitors (which may stop the run), the record (a step late under ``lag``), the non-finite policy and
    the checkpointer. On a stop request the window in progress is finished and stepped, a checkpoint is written
    and :class:`StopRequested` is raised.
    """
    end = min(until if until is not None else settings.max_steps, settings.max_steps)
    first, lagged = len(state.records), None
    budget = math.inf if settings.max_samples is None else settings.max_samples
    trained = sum(map(run_samples, state.records))  # trainer.max_samples counts a resumed run's steps too
    state.model.train()
    while state.source.next_step < end and trained < budget:
        parts.timer.start_step()
        done = run_step(state, settings, loss_fn, parts)
        step, totals = done.number, done.totals
        trained += done.window.samples  # the data order's window: every island's, the same on every rank
        if trained >= budget:  # trainer.max_samples: this step reached it, the run ends after it
            end = step
        stopping, due = totals.stop_votes > 0, totals.checkpoint_votes > 0
        extra: Record = {}
        if parts.outer is not None:  # islands: the votes count where every island meets, at its syncs
            stopping, due = parts.outer.merge_if_due(step, totals.items, stopping, due)
            extra = parts.outer.fields()
        if parts.fingerprint is not None:  # the previous step's comparison came with this window
            parts.fingerprint.judge(step, totals, done.result)
        for monitor in parts.monitors:
            monitor.after_step(step, totals, done.c, done.d)
        times = parts.timer.finish_step(sync=not parts.lag)
        nonfinite = parts.nonfinite.observe(state, totals, done.result)
        ended = StepEnd(done, times, nonfinite, extra, island=parts.outer is not None)
        if lagged is not None:  # the previous step's record, whose events step n's queued work follows
            lagged.publish(state, parts)
        checkpointer = parts.checkpointer
        saves = checkpointer is not None and checkpointer.saves_after(step, due=due, stopping=stopping)
        at_once = saves or stopping or step >= end or parts.nonfinite.exhausted(state) or parts.flushes(step)
        lagged = ended if parts.lag and not at_once else None
        if lagged is None:
            ended.publish(state, parts)
        parts.nonfinite.enforce(state, step, totals, done.result)
        if (saves or stopping or step >= settings.max_steps) and parts.fingerprint is not None:
            parts.fingerprint.flush()  # nothing unjudged is saved or left behind
        path = checkpointer.save(state) if saves and checkpointer is not None else None
        if stopping:
            raise StopRequested(step, path)
    return state.records[first:]
