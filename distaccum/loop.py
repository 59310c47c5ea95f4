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

``accum.loss_norm=mean_per_micro`` is the classic loss/K (each micro-batch's mean divided by
K x W) and is wrong whenever micro-batches hold different numbers of items; it is kept only as a
negative control that ``distaccum verify`` must catch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from distaccum.checkpoint import StopFlag, StopRequested
from distaccum.checks import check_consistency
from distaccum.config import Split
from distaccum.engines.base import Engine
from distaccum.gns import estimate, record_fields, window_terms
from distaccum.losses import LossFn
from distaccum.pipeline import WindowSource, to_device
from distaccum.sinks import Record, Sink
from distaccum.timing import StepTimer


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
    run_dir: Path
    device: torch.device
    rank: int
    grad_scale_fault: float = 1.0
    """Test-only (``debug.grad_scale_fault``): a constant wrong factor on every gradient."""
    nominal_partial_count: bool = False
    """Test-only (``debug.nominal_partial_count``): normalize partial windows as if they were full."""
    gns_decay: float | None = None
    """``log.gns``: record the gradient noise scale, smoothed with this decay (None: off)."""


def power_of_two_scale(n_prev: float, global_batch: int) -> float:
    """c = 2^-round(log2 N_prev) (the global batch before the first window): exact to multiply by."""
    reference = n_prev if n_prev > 0 else float(global_batch)
    return 2.0 ** -round(math.log2(max(reference, 1.0)))


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
                # An empty piece trained a stand-in sample: weight 0, no items (see pipeline).
                weight = 1.0 if real else 0.0
                n = torch.as_tensor(n_items, device=device).to(torch.float64) * weight
                if settings.loss_norm == "global_count":
                    factor: Any = c * d * weight  # S_rk * c * d: the derivation at the top of this module
                else:  # the classic loss/K with a per-micro mean, kept only to show it is wrong
                    factor = c * d * weight / (n.clamp(min=1.0) * split.accum_steps * split.world_size)
                engine.backward(summed * factor)
            items += n
            counts.append(n)
            loss_sum += summed.detach().to(torch.float64) * weight
        timer.compute_done()

        # One all-reduce per step: N, the loss sum and the stop flag (so every rank agrees to stop
        # after the same window), and with log.gns the noise-scale terms (distaccum.gns).
        stop_flag = torch.tensor(float(stop is not None and stop.requested), dtype=torch.float64, device=device)
        stats = [items, loss_sum, stop_flag]
        if squares is not None:
            stats += window_terms(squares, items, c, d)
        totals = torch.stack(stats)
        dist.all_reduce(totals)
        count = totals[0].clamp(min=1.0)
        if settings.nominal_partial_count and window.partial:  # the remainder-window bug, on purpose
            count = count * (split.global_batch / window.samples)
        if settings.loss_norm == "global_count":
            grad_scale = settings.grad_scale_fault / (c * count)
        else:
            grad_scale = torch.tensor(settings.grad_scale_fault / c, dtype=torch.float64, device=device)
        lr = state.scheduler.get_last_lr()[0]
        result = engine.step(settings.clip_norm, grad_scale)  # normalize, clip, step: once per window
        if result.applied:  # a skipped step must not advance the schedule
            state.scheduler.step()
        state.source.advance()
        if settings.check_every and window.step % settings.check_every == 0:
            check_consistency(engine, window.step + 1, settings.run_dir, record=settings.record_checksums)
        times = timer.end_step()
        # Host read of the step's totals (on CUDA the timer already synchronized), then one
        # all-gather of host floats for the per-rank view: compute time and micro-batch item counts.
        n_total, loss_total, stop_votes, *gns_sums = totals.tolist()
        samples = window.samples
        local = [float(x) for x in torch.stack(counts).tolist()]
        per_rank = timer.gather([times.compute_s, min(local), max(local)])
        state.n_prev = n_total
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
            **times.as_record(),  # time_s, data_s, compute_s, optim_s, comm_*, peak_mem_bytes
            "compute_min_s": float(per_rank[:, 0].min()),
            "compute_max_s": float(per_rank[:, 0].max()),
            "micro_items_min": round(float(per_rank[:, 1].min())),
            "micro_items_max": round(float(per_rank[:, 2].max())),
            "samples_per_s": samples / times.time_s,
            "items_per_s": n_total / times.time_s,
        }
        if squares is not None and settings.gns_decay is not None:
            grad_sq, trace = estimate(gns_sums, n_total, split.world_size)
            record.update(record_fields(grad_sq, trace, state.records[-1] if state.records else None,
                                        settings.gns_decay))
        state.records.append(record)
        sink.log(record)
        if on_step is not None:
            on_step(state, record)
        if stop_votes > 0:
            path = checkpoint(state) if checkpoint is not None else settings.run_dir
            raise StopRequested(window.step + 1, path)
    return state.records[first:]
