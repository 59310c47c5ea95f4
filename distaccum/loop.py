"""The accumulation loop: K micro-batches per rank, one gradient reduction, one optimizer step.

The math, for one optimizer step (a *window*). Rank r's micro-batch k has summed loss S_rk over
n_rk loss items; N = sum_rk n_rk is the window's global item count. The gradient we want is the
full-batch one:

    grad L = sum_rk grad S_rk / N

N is only known once every micro-batch's forward has run (the loss reports n_rk; a streaming
source cannot count ahead), so each micro-batch backpropagates

    S_rk * c * d        d = engine.grad_divisor (undoes the engine's own averaging)
                        c = 2^-round(log2 N_prev), the same power of two on every rank

and after the last micro-batch ONE all-reduce gives N (with the window's loss sum, sample count
and the stop flag). The engine then multiplies the accumulated gradient sum_rk c grad S_rk by
1/(c N) and clips it, in one pass. c keeps gradients at the scale of a mean (what fp16 loss
scaling expects); being a power of two, multiplying by it is exact in floating point, so it never
changes a bit of the result — a resumed run, whatever its N_prev, matches an uninterrupted one.
Partial windows need nothing special: N counts what the window holds, never K x micro_batch.

Host synchronizations per optimizer step on CUDA (steady state; ``tests/test_ledger_gpu.py``
counts them with ``torch.cuda.set_sync_debug_mode``). Nothing in the micro-batch loop waits for the
device: batches are copied non-blocking from pinned memory and item counts are filled in on the
device. The loop syncs once, in ``StepTimer.end_step`` (``torch.cuda.synchronize``, after which it
resolves the step's CUDA events and reads the window's totals and item counts in ONE copy from the
idle device). The engine's ``step`` adds its own: DDP and Accelerate read the gradient norm once
(the update depends on it being finite) and fp16 adds GradScaler's three reads (found-inf, the
scale before and after its update). ``set_sync_debug_mode`` flags the reads, not the explicit
``synchronize``, so a DDP or Accelerate step shows exactly **2** flagged syncs in fp32/bf16/fp64
and **5** in fp16. Not included: DDP's one-time bucket rebuild (step 2), tripwire steps
(``trainer.check_every``: one more read per rank's checksums) and the internals of FSDP (whose
``step`` also reads the norm once) and DeepSpeed.

``accum.loss_norm=mean_per_micro`` is the classic loss/K (each micro-batch's mean divided by
K x W) and is wrong whenever micro-batches hold different numbers of items; it is kept only as a
negative control that ``distaccum verify`` must catch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distaccum.cluster.stopping import StopFlag, StopRequested
from distaccum.config import Split
from distaccum.data.pipeline import WindowSource, to_device
from distaccum.engines.base import Engine
from distaccum.losses import LossFn
from distaccum.telemetry.gns import estimate, record_fields, window_terms
from distaccum.telemetry.sinks import Record, Sink
from distaccum.telemetry.timing import StepTimer
from distaccum.verify.tripwire import check_consistency


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
    last_checkpoint: float = field(default_factory=time.monotonic)
    """When the last checkpoint was written (rank 0's clock decides time-based checkpoints)."""


@dataclass(frozen=True)
class LoopSettings:
    """What the loop needs besides its state, resolved once at the worker boundary."""

    split: Split
    max_steps: int
    clip_norm: float | None
    every_micro: bool
    loss_norm: str
    float_dtype: torch.dtype | None
    """Cast floating batch tensors to this dtype (fp64 runs); None leaves them."""
    check_every: int
    record_checksums: bool
    rank_stats_every: int
    run_dir: Path
    device: torch.device
    rank: int
    checkpoint_every: int = 0
    """Checkpoint after every N-th optimizer step (0: only when stopping)."""
    checkpoint_every_s: float = 0.0
    """Also checkpoint when this many seconds passed since the last one (0: never by time)."""
    max_nonfinite_steps: int = 3
    """Stop the run after this many consecutive steps skipped for non-finite values."""
    loss_scaling: bool = False
    """fp16 with a GradScaler: its overflow skips are routine and do not count as non-finite."""
    grad_scale_fault: float = 1.0
    """Test-only (``debug.grad_scale_fault``): a constant wrong factor on every gradient."""
    nominal_partial_count: bool = False
    """Test-only (``debug.nominal_partial_count``): normalize partial windows as if they were full."""
    nan_steps: tuple[int, ...] = ()
    """Test-only (``debug.nan_at_step``): 1-based steps whose loss is NaN on rank ``nan_rank``."""
    nan_rank: int = 0
    gns_decay: float | None = None
    """``log.gns``: record the gradient noise scale, smoothed with this decay (None: off)."""


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient."""


def power_of_two_scale(n_prev: float, global_batch: int) -> float:
    """c = 2^-round(log2 N_prev) (the global batch before the first window): exact to multiply by."""
    reference = n_prev if n_prev > 0 else float(global_batch)
    return 2.0 ** -round(math.log2(max(reference, 1.0)))


def item_count(n_items: torch.Tensor | int | float, device: torch.device) -> torch.Tensor:
    """A micro-batch's loss-item count as a float64 scalar on ``device``, without a host sync: a
    Python number is filled in on the device (``torch.tensor(n, device=cuda)`` would copy and wait)."""
    if isinstance(n_items, torch.Tensor):
        return n_items.to(device, torch.float64, non_blocking=True)
    return torch.full((), float(n_items), dtype=torch.float64, device=device)


def train(state: TrainState, settings: LoopSettings, loss_fn: LossFn, timer: StepTimer, sink: Sink, *,
          until: int | None = None, stop: StopFlag | None = None,
          checkpoint: Callable[[TrainState], Path] | None = None,
          on_step: Callable[[TrainState, Record], None] | None = None) -> list[Record]:
    """Run optimizer steps until step ``until`` (default ``settings.max_steps``); returns the records
    of the steps run by this call (identical on every rank; ``state.records`` holds them all).

    Windows come from ``state.source`` (this rank's K collated micro-batches each). On a stop
    request the window in progress is finished and stepped, ``checkpoint(state)`` runs, and
    :class:`StopRequested` is raised.
    """
    split, engine, model = settings.split, state.engine, state.model
    device = settings.device
    end = min(until if until is not None else settings.max_steps, settings.max_steps)
    first = len(state.records)
    squares = getattr(engine, "grad_squares", None) if settings.gns_decay is not None else None
    model.train()
    while state.source.next_step < end:
        timer.start_step()
        window = state.source.window()
        c = power_of_two_scale(state.n_prev, split.global_batch)
        d = engine.grad_divisor
        items = torch.zeros((), dtype=torch.float64, device=device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        counts: list[torch.Tensor] = []
        for k in range(split.accum_steps):
            boundary = k == split.accum_steps - 1
            timer.start_micro()
            micro = next(window.micro)
            real = micro.samples > 0
            batch = to_device(micro.batch, device, settings.float_dtype)
            del micro  # one collated micro-batch alive at a time
            timer.batch_ready()
            with engine.sync(boundary or settings.every_micro):
                with engine.forward_context():
                    summed, n_items = loss_fn(model, batch)
                if window.step + 1 in settings.nan_steps and settings.rank == settings.nan_rank:
                    summed = summed * float("nan")  # test-only fault injection (debug.nan_at_step)
                # An empty piece trained a stand-in sample: weight 0, no items (see pipeline).
                weight = 1.0 if real else 0.0
                n = item_count(n_items, device) * weight
                items += n
                counts.append(n)
                loss_sum += summed.detach().to(torch.float64) * weight
                if boundary:
                    # The window's one all-reduce: N and the loss sum, plus flags every rank must
                    # agree on (a non-finite loss on some rank, a stop request, a time-based
                    # checkpoint due by rank 0's clock), plus each rank's non-finite verdict and
                    # smallest/largest micro-batch item count in its own slot (zeros elsewhere: the
                    # sum is an all-gather). Launched before the last backward, which it overlaps:
                    # only the step after it needs N. Everything is filled in on the device (no
                    # host-to-device copy, so no sync).
                    due = settings.rank == 0 and 0 < settings.checkpoint_every_s <= \
                        time.monotonic() - state.last_checkpoint
                    flag = float(stop is not None and stop.requested)
                    bad = (~torch.isfinite(loss_sum)).to(torch.float64)
                    per_micro = torch.stack(counts)
                    slots = torch.zeros(3, split.world_size, dtype=torch.float64, device=device)
                    slots[:, settings.rank] = torch.stack([bad, per_micro.min(), per_micro.max()])
                    totals = torch.cat([torch.stack([items, loss_sum, bad,
                                                     torch.full((), flag, dtype=torch.float64, device=device),
                                                     torch.full((), float(due), dtype=torch.float64,
                                                                device=device)]), slots.flatten()])
                    reduction = dist.all_reduce(totals, async_op=True)
                if settings.loss_norm == "global_count":
                    factor: Any = c * d * weight  # S_rk * c * d: the derivation at the top of this module
                else:  # the classic loss/K with a per-micro mean, kept only to show it is wrong
                    factor = c * d * weight / (n.clamp(min=1.0) * split.accum_steps * split.world_size)
                engine.backward(summed * factor)
        timer.compute_done()
        reduction.wait()
        gns_totals = None
        if squares is not None:
            # log.gns: the noise-scale terms (distaccum.telemetry.gns) exist only after the boundary backward
            # (the DDP hook measured them): one more all-reduce, of three numbers.
            gns_totals = torch.stack(window_terms(squares, items, c, d))
            dist.all_reduce(gns_totals)
        count = totals[0].clamp(min=1.0)
        if settings.nominal_partial_count and window.partial:  # the remainder-window bug, on purpose
            count = count * (split.global_batch / window.samples)
        if settings.loss_norm == "global_count":
            grad_scale = settings.grad_scale_fault / (c * count)
        else:
            grad_scale = torch.full((), settings.grad_scale_fault / c, dtype=torch.float64, device=device)
        # A non-finite loss on any rank: scale the gradient by NaN, so every engine's own check of
        # the (global) gradient norm skips the update on every rank alike.
        grad_scale = torch.where(totals[2] > 0, torch.full_like(totals[2], float("nan")), grad_scale)
        lr = state.scheduler.get_last_lr()[0]
        result = engine.step(settings.clip_norm, grad_scale)  # normalize, clip, step: once per window
        if result.applied:  # a skipped step must not advance the schedule
            state.scheduler.step()
        state.source.advance()
        if settings.check_every and window.step % settings.check_every == 0:
            check_consistency(engine, window.step + 1, settings.run_dir, record=settings.record_checksums)
        times = timer.end_step()
        # One host read of the step's totals (on CUDA the timer has synchronized: the device is idle).
        host = totals.tolist()
        n_total, loss_total, bad_loss, stop_votes, due_votes = host[:5]
        world = split.world_size
        bad_ranks = [r for r in range(world) if host[5 + r] > 0]
        items_min, items_max = min(host[5 + world:5 + 2 * world]), max(host[5 + 2 * world:])
        samples = window.samples
        state.n_prev = n_total
        nonfinite = bad_loss > 0 or (not result.applied and not settings.loss_scaling)
        state.nonfinite_streak = state.nonfinite_streak + 1 if nonfinite else 0
        record: Record = {
            "step": window.step + 1,
            "epoch": window.epoch,
            "loss": loss_total / n_total if n_total else float("nan"),
            "lr": lr,
            "samples": samples,
            "items": round(n_total),
            "micro_steps": split.accum_steps,
            "partial_window": window.partial,
            "grad_norm": result.grad_norm,
            "skipped": not result.applied,
            "nonfinite": nonfinite,
            **times.as_record(),  # time_s, data_s, compute_s, optim_s, comm_*, peak_mem_bytes
            "micro_items_min": round(items_min),
            "micro_items_max": round(items_max),
            "samples_per_s": samples / times.time_s,
            "items_per_s": n_total / times.time_s,
        }
        if settings.rank_stats_every and (window.step + 1) % settings.rank_stats_every == 0:
            # The straggler view: every rank's compute time (one all-gather of host floats; every
            # N steps, since on a slow interconnect it costs as much as a tiny step).
            compute = timer.gather([times.compute_s])[:, 0]
            record["compute_min_s"], record["compute_max_s"] = float(compute.min()), float(compute.max())
        if gns_totals is not None and settings.gns_decay is not None:
            grad_sq, trace = estimate(gns_totals.tolist(), n_total, split.world_size)
            record.update(record_fields(grad_sq, trace, state.records[-1] if state.records else None,
                                        settings.gns_decay))
        state.records.append(record)
        sink.log(record)
        if on_step is not None:
            on_step(state, record)
        if state.nonfinite_streak >= settings.max_nonfinite_steps:
            ranks = bad_ranks
            raise NonFiniteError(
                f"{state.nonfinite_streak} consecutive optimizer steps (up to step {window.step + 1}) had non-finite "
                "values and were skipped on every rank (trainer.max_nonfinite_steps="
                f"{settings.max_nonfinite_steps}). At step {window.step + 1}: "
                + (f"the loss was non-finite on rank(s) {', '.join(map(str, ranks))}; " if ranks else
                   "the loss was finite but the gradient was not; ")
                + f"first parameter with a non-finite gradient on rank 0: {result.nonfinite_param or 'n/a'}. "
                "Parameters are those of the last finite step; no checkpoint holds a non-finite value. Lower the "
                "learning rate or check the data of these steps.")
        periodic = settings.checkpoint_every and (window.step + 1) % settings.checkpoint_every == 0
        # A skipped step leaves the parameters as the last finite update made them, so a checkpoint
        # written after one never holds a non-finite value.
        path = settings.run_dir
        if checkpoint is not None and (stop_votes > 0 or periodic or due_votes > 0):
            path = checkpoint(state)
            state.last_checkpoint = time.monotonic()
        if stop_votes > 0:
            raise StopRequested(window.step + 1, path)
    return state.records[first:]
