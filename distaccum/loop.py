"""The accumulation loop: K micro-batches per rank, one gradient reduction, one optimizer step.

The math, for one optimizer step (a *window*). Rank r's micro-batch k has summed loss S_rk over
n_rk loss items; N = sum_rk n_rk is the window's global item count. The gradient we want is the
full-batch one:

    grad L = sum_rk grad S_rk / N

N is only known once every micro-batch's forward has run (the loss reports n_rk; a streaming
source cannot count ahead), so each micro-batch backpropagates

    S_rk * c * d        d = engine.grad_divisor (undoes the engine's own averaging)
                        c = 2^-round(log2 N_prev), the same power of two on every rank

and after the last micro-batch ONE collective gives N (with the window's loss sum, sample count
and the stop flag): an all-gather of each rank's numbers, summed on the host (on an accelerator the device also sums
N for the scale; on the CPU an all-reduce would cost gloo twice the CPU time: :mod:`distaccum.window`). The engine then multiplies the accumulated
gradient sum_rk c grad S_rk by 1/(c N) and clips it, in one pass (DDP and Accelerate fold it into the reduction:
``Engine.fold_normalization``). A window of one micro-batch (K = 1) can skip that pass: an engine that
offers ``Engine.normalize_loss`` (DDP and Accelerate on the CPU) has the loop wait for N before the
backward and backpropagate S_r * c * (1/(c N)) = S_r / N, and reduces the gradient as a plain sum.
c keeps gradients at the scale of a mean (what fp16 loss scaling expects); being a power of two, multiplying by it is exact in floating point, so it never
changes a bit of the result — a resumed run, whatever its N_prev, matches an uninterrupted one.
Partial windows need nothing special: N counts what the window holds, never K x micro_batch.

Host synchronizations per optimizer step on CUDA (steady state; ``tests/test_ledger_gpu.py``
counts them with ``torch.cuda.set_sync_debug_mode``). Nothing in the micro-batch loop waits for the
device: batches are copied non-blocking from pinned memory, item counts the loss returns as tensors are
summed on the device and those it returns as Python numbers on the host (on the CPU, where reading a tensor
waits for nothing, all the window's sums are Python floats: :class:`~distaccum.window.HostTotals`). The window's totals are copied into pinned host memory where they land (:class:`~distaccum.window.DeviceTotals`;
for DDP and Accelerate while the last backward still runs) and read after an event, which drains nothing; the
step's timings are CUDA events resolved a step later (:class:`StepEnd`, ``LoopParts.lag``: the Trainer's default on
CUDA), so the host prepares step n+1 while the device still computes step n, as a hand-written loop's host runs
ahead. What is left is the engine's: DDP and Accelerate read the gradient norm once when there is one (clipping,
``log.grad_norm``: the update depends on it being finite; without one the loss's verdict comes from the totals),
and fp16 adds GradScaler's three reads (found-inf, the scale before and after its update). So a DDP or Accelerate
step shows exactly **1** flagged sync in fp32/bf16/fp64 (**0** without a norm) and **4** in fp16, and a
``train_steps`` call never calls ``torch.cuda.synchronize`` (with ``lag=False`` the timer makes one per step, which
the debug mode does not flag). Not included: DDP's one-time bucket rebuild (step 2), tripwire steps
(``trainer.check_every``: one more read per rank's checksums), ``log.gns`` (a read per step) and the internals of
FSDP (whose ``step`` also reads the norm once) and DeepSpeed.

What is not step math lives in the components that own it and is handed in (:class:`LoopParts`):
when to checkpoint (:class:`~distaccum.rundir.checkpoint.Checkpointer`), what to do about non-finite
steps (:class:`NonFinitePolicy`), checks of the reduced gradient before the step uses it
(:class:`ReductionCheck`: the reduction fingerprint), and per-step observers (:class:`StepMonitor`: the
cross-rank tripwire, the straggler view, the gradient noise scale).

``accum.loss_norm=mean_per_micro`` is the classic loss/K (each micro-batch's mean divided by
K x W) and is wrong whenever micro-batches hold different numbers of items; it is kept only as a
negative control that ``distaccum verify`` must catch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from distaccum.cluster.exchange import RowExchange
from distaccum.cluster.stopping import StopFlag, StopRequested
from distaccum.data.pipeline import WindowBatches, WindowSource, to_device
from distaccum.engines.base import Engine, StepResult
from distaccum.losses import LossFn
from distaccum.split import Split
from distaccum.telemetry.sinks import Record, Sink
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


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs besides its state and parts, resolved once (:func:`distaccum.resolve.resolve`)."""

    split: Split
    max_steps: int
    clip_norm: float | None
    every_micro: bool
    """Reduce after every micro-batch (``accum.sync=every_micro``) instead of only at the boundary."""
    loss_norm: str
    float_dtype: torch.dtype | None
    """Cast floating batch tensors to this dtype (fp64 runs); None leaves them."""
    device: torch.device
    rank: int


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


def power_of_two_scale(n_prev: float, global_batch: int) -> float:
    """c = 2^-round(log2 N_prev) (the global batch before the first window): exact to multiply by."""
    reference = n_prev if n_prev > 0 else float(global_batch)
    return 2.0 ** -round(math.log2(max(reference, 1.0)))


def micro_factor(loss_norm: str, scale: float, n: torch.Tensor | float, split: Split) -> Any:
    """What one micro-batch's summed loss is multiplied by before backward: c * d (* its weight); the
    classic loss/K divides by the micro-batch's own items and K x W instead (the negative control)."""
    if loss_norm == "global_count":
        return scale
    if isinstance(n, torch.Tensor):
        return scale / (n.clamp(min=1.0) * split.accum_steps * split.world_size)
    return 1.0 / (max(n, 1.0) * split.accum_steps * split.world_size) * scale  # as the tensor's scale / t does


def hand_over(engine: Engine, scale: Callable[[], torch.Tensor], split: Split) -> torch.Tensor | None:
    """Offer the window's 1/(c N) to the engine before its last backward: into the loss of a window of one
    micro-batch (the factor it returns, :meth:`~distaccum.engines.base.Engine.normalize_loss`), else folded into
    its reduction (:meth:`~distaccum.engines.base.Engine.fold_normalization`) or left to its step (None)."""
    factor = engine.normalize_loss(scale) if split.accum_steps == 1 else None
    if factor is None:
        engine.fold_normalization(scale)
    return factor


def loss_factor(factor: torch.Tensor | None, loss_norm: str, c: float, d: float, weight: float,
                n: torch.Tensor | float, split: Split, dtype: torch.dtype) -> Any:
    """What a micro-batch's summed loss is multiplied by: c * d * its weight (:func:`micro_factor`); when the engine
    took the window's normalization into the loss (``factor``, K = 1), that factor times c * weight instead, in the
    loss's dtype (the reduction is then a plain sum: ``d`` does not apply)."""
    if factor is None:
        return micro_factor(loss_norm, c * d * weight, n, split)
    return (factor * micro_factor(loss_norm, c * weight, n, split)).to(dtype)


class StepMonitor(Protocol):
    """Observes each optimizer step; owns its own cadence. ``after_step`` runs before the step's timing
    ends (it may issue collectives: every rank calls it); ``fields`` adds record fields afterwards."""

    def after_step(self, step: int, window: WindowTotals, c: float, d: float) -> None: ...

    def fields(self, record: Record, times: StepTimes, records: list[Record]) -> Record: ...


class ReductionCheck(Protocol):
    """Looks at the step right after the boundary reduction, before the optimizer uses the gradient, and
    compares what it saw across ranks later: its numbers ride on the next window's collective
    (:meth:`before_reduce` hands them to :meth:`WindowTotals.carry`), so checking adds no collective and no
    wait to the step, and :meth:`judge` is called one step later, once that window's totals are read; before
    a checkpoint, a tripwire check and at the run's end it is called for the current step too, and gathers
    what no window carried yet itself (collective: every rank's loop calls it at the same step). ``judge``
    raises to stop the run."""

    def before_reduce(self, window: WindowTotals) -> None: ...

    def after_reduction(self, step: int, window: WindowTotals) -> None: ...

    def judge(self, through: int) -> None: ...


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
            f"{step}: " + (f"the loss was non-finite on rank(s) {', '.join(map(str, ranks))}; " if ranks else
                           "the loss was finite but the gradient was not; ")
            + f"first parameter with a non-finite gradient on rank 0: {result.nonfinite_param or 'n/a'}. "
            "Parameters are those of the last finite step; no checkpoint holds a non-finite value. Lower the "
            "learning rate or check the data of these steps.")


class Checkpointing(Protocol):
    """When to checkpoint (:class:`distaccum.rundir.checkpoint.Checkpointer`)."""

    def due_by_time(self) -> bool: ...

    def saves_after(self, step: int, *, due: bool, stopping: bool) -> bool: ...

    def save(self, state: TrainState) -> Path: ...


@dataclass
class LoopParts:
    """The components the loop hands each step to."""

    timer: StepTimer
    sink: Sink
    nonfinite: NonFinitePolicy
    checkpointer: Checkpointing | None = None
    monitors: list[StepMonitor] = field(default_factory=list)
    checks: list[ReductionCheck] = field(default_factory=list)
    stop: StopFlag | None = None
    on_step: Callable[[TrainState, Record], None] | None = None
    lag: bool = False
    """Hand step n's record to the sinks and ``on_step`` once step n+1 is queued (:class:`StepEnd`)."""
    flush_after: Callable[[int], bool] | None = None
    """Steps whose record must be handed over before the next step starts, under ``lag`` (an evaluation's)."""
    exchange: RowExchange | None = None
    """How the CPU window's rows travel (:func:`~distaccum.cluster.exchange.window_exchange`; None: gloo)."""


@dataclass
class StepEnd:
    """An optimizer step whose work is queued, and what its record needs. With ``LoopParts.lag`` (CUDA) the
    loop hands the record over one step late: step n's CUDA timings are resolved once step n+1's work is
    queued, so the host never drains the device's queue to time a step and prepares the next window while the
    device still computes this one. A step that checkpoints, stops, ends the call, reaches the non-finite limit
    or is named by ``LoopParts.flush_after`` is handed over at once, so checkpoints, evaluations and the records
    a call returns are exactly the step's. ``on_step`` then runs with the model one step further than its record.
    A run that fails during step n+1 loses step n's record (never a checkpointed step's: those are handed over at
    once, so a resumed run's records are complete)."""

    window: WindowBatches
    host: WindowResult
    result: StepResult
    lr: float
    times: PendingTimes
    nonfinite: bool

    def hand_over(self, state: TrainState, parts: LoopParts, split: Split) -> None:
        """Resolve the step's timings (waiting for its own events only), then record, log and call ``on_step``."""
        times = self.times.resolve()
        record = step_record(self.window, split, self.host, self.result, self.lr, times, self.nonfinite)
        for monitor in parts.monitors:
            record.update(monitor.fields(record, times, state.records))
        state.records.append(record)
        parts.sink.log(record)
        if parts.on_step is not None:
            parts.on_step(state, record)


def step_record(window: WindowBatches, split: Split, totals: WindowResult, result: StepResult, lr: float,
                times: StepTimes, nonfinite: bool) -> Record:
    """The step's ``metrics.jsonl`` line (identical on every rank but the timings)."""
    n = totals.items
    return {"step": window.step + 1, "epoch": window.epoch, "loss": totals.loss_sum / n if n else float("nan"),
            "lr": lr, "samples": window.samples, "items": round(n), "micro_steps": split.accum_steps,
            "partial_window": window.partial, "grad_norm": result.grad_norm, "skipped": not result.applied,
            "nonfinite": nonfinite,
            **times.as_record(),  # time_s, data_s, compute_s, optim_s, comm_*, peak_mem_bytes
            "micro_items_min": round(totals.items_min), "micro_items_max": round(totals.items_max),
            "samples_per_s": window.samples / times.time_s, "items_per_s": n / times.time_s}


def train(state: TrainState, settings: LoopSettings, loss_fn: LossFn, parts: LoopParts, *,
          until: int | None = None) -> list[Record]:
    """Run optimizer steps until step ``until`` (default ``settings.max_steps``); returns the records
    of the steps run by this call (identical on every rank; ``state.records`` holds them all).

    Windows come from ``state.source`` (this rank's K collated micro-batches each). On a stop
    request the window in progress is finished and stepped, the checkpointer writes a checkpoint,
    and :class:`StopRequested` is raised.
    """
    split, engine, model, timer = settings.split, state.engine, state.model, parts.timer
    end = min(until if until is not None else settings.max_steps, settings.max_steps)
    first = len(state.records)
    lagged: StepEnd | None = None
    model.train()
    while state.source.next_step < end:
        timer.start_step()
        window = state.source.window()  # 1. fetch the window
        c = power_of_two_scale(state.n_prev, split.global_batch)
        d = engine.grad_divisor
        totals = WindowTotals.for_device(split, settings.rank, settings.device, parts.exchange)
        for k in range(split.accum_steps):  # 2. K micro-steps, gradients accumulating locally
            boundary = k == split.accum_steps - 1
            timer.start_micro()
            micro = next(window.micro)
            weight = 1.0 if micro.samples > 0 else 0.0  # an empty piece trained a stand-in sample (pipeline)
            batch = to_device(micro.batch, settings.device, settings.float_dtype)
            del micro  # one collated micro-batch alive at a time
            timer.batch_ready()
            with engine.sync(boundary or settings.every_micro):
                with engine.forward_context():
                    summed, n_items = loss_fn(model, batch)
                n = totals.add(summed, n_items, weight)
                factor = None
                if boundary:  # N's collective, launched before the last backward, which it overlaps
                    for check in parts.checks:  # the previous step's comparison rides on it
                        check.before_reduce(totals)
                    totals.reduce(stop=parts.stop is not None and parts.stop.requested,
                                  checkpoint_due=parts.checkpointer is not None and parts.checkpointer.due_by_time())
                    factor = hand_over(engine, partial(totals.grad_scale, c, settings.loss_norm), split)
                engine.backward(summed * loss_factor(factor, settings.loss_norm, c, d, weight, n, split,
                                                     summed.dtype))
        timer.compute_done()
        grad_scale = totals.grad_scale(c, settings.loss_norm)  # 3. the one reduction: 1/(c N)
        step = window.step + 1
        for check in parts.checks:  # the reduced gradient, compared across ranks while the step runs
            check.after_reduction(step, totals)
        host = totals.read()  # the window's totals (on CUDA from their pinned copy: no drain)
        lr = state.scheduler.get_last_lr()[0]
        result = engine.step(settings.clip_norm, grad_scale, loss_finite=not host.bad_ranks)  # 4. once per window
        if result.applied:  # a skipped step must not advance the schedule
            state.scheduler.step()
        state.source.advance()
        for monitor in parts.monitors:
            monitor.after_step(step, totals, c, d)
        times = timer.finish_step(sync=not parts.lag)
        for check in parts.checks:  # the previous step's comparison: it came with this window's totals
            check.judge(step - 1)
        state.n_prev = host.items
        ended = StepEnd(window, host, result, lr, times, parts.nonfinite.observe(state, host, result))
        if lagged is not None:  # 5. record: the previous step's, whose events step n's queued work follows
            lagged.hand_over(state, parts, split)
        stopping, checkpointer = host.stop_votes > 0, parts.checkpointer
        saves = checkpointer is not None and checkpointer.saves_after(step, due=host.checkpoint_votes > 0,
                                                                      stopping=stopping)
        lagged = ended if parts.lag and not (saves or stopping or step >= end or parts.nonfinite.exhausted(state)
                                             or parts.flush_after is not None and parts.flush_after(step)) else None
        if lagged is None:
            ended.hand_over(state, parts, split)
        parts.nonfinite.enforce(state, step, host, result)
        if saves or stopping or step >= settings.max_steps:  # nothing pending is saved or left unjudged
            for check in parts.checks:
                check.judge(step)
        path = checkpointer.save(state) if saves and checkpointer is not None else None
        if stopping:
            raise StopRequested(step, path)
    return state.records[first:]
