"""The accumulation loop: one optimizer step per window, gradients reduced once at its boundary.

The math, written out once. Let a window (one optimizer step) hold loss items i over all K
micro-batches on all W ranks, N = their count. The full-batch objective is

    L = (1/N) * sum_i l_i     and     grad L = (1/N) * sum_{r,k} grad(sum_{i in micro k of rank r} l_i).

So each micro-batch backpropagates ``S_rk / N`` (its *summed* loss over the *global* N) and the
engine sums the gradients over k locally (accumulation) and over r across ranks (one reduction).
Dividing each micro-batch by its own mean and by K instead (``mean_per_micro``) is only equal when
every micro-batch holds the same number of items — it is wrong for variable-length sequences and
for partial windows. Engines that average across ranks (or divide by K themselves) declare it in
``grad_divisor`` and we multiply it back, so the gradient is still exactly grad L.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from distaccum.backend import Backend
from distaccum.checkpoint import CHECKPOINT_NAME, StopFlag, StopRequested, load, save
from distaccum.checks import check_consistency
from distaccum.comm import CommLedger
from distaccum.config import RunConfig, Split
from distaccum.data import Dataset, GlobalBatchPlan
from distaccum.models import LossFn, batch_stat_layers
from distaccum.optim import build_optimizer, build_scheduler
from distaccum.sinks import Record, Sink
from distaccum.timing import StepTimer


@dataclass
class TrainState:
    """Everything the loop mutates, kept together so a checkpoint can save and restore it."""

    model: nn.Module
    backend: Backend
    scheduler: torch.optim.lr_scheduler.LRScheduler
    plan: GlobalBatchPlan
    records: list[Record] = field(default_factory=list)


def setup(cfg: RunConfig, model: nn.Module, backend: Backend, split: Split,
          dataset: Dataset) -> TrainState:
    """Wrap the model, build optimizer/scheduler (after wrapping: engines own their parameters)."""
    layers = batch_stat_layers(model)
    if layers and split.accum_steps > 1:
        warnings.warn(
            f"accumulating {split.accum_steps} micro-batches with batch-statistics layers "
            f"({', '.join(layers)}): their statistics are computed per micro-batch of {split.micro_batch}, "
            "not over the effective batch, so results depend on the split",
            stacklevel=2,
        )
    wrapped = backend.wrap(model, lambda params: build_optimizer(params, cfg.optim))
    scheduler = build_scheduler(backend.optimizer, cfg.optim, cfg.trainer.max_steps)
    plan = GlobalBatchPlan(len(dataset), split.global_batch, seed=cfg.trainer.seed,
                           shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
    return TrainState(wrapped, backend, scheduler, plan)


def save_checkpoint(cfg: RunConfig, state: TrainState, rank: int) -> Path:
    """Write run_dir/checkpoint.pt between windows (collective: engines may gather shards)."""
    path = Path(cfg.run_dir) / CHECKPOINT_NAME
    payload = {"backend": state.backend.state_dict(), "scheduler": state.scheduler.state_dict(),
               "plan": state.plan.state_dict(), "steps_done": len(state.records)}
    if rank == 0:
        save(path, payload)
    dist.barrier()  # nobody exits before the checkpoint is on disk
    return path


def resume(cfg: RunConfig, state: TrainState) -> int:
    """Restore run_dir/checkpoint.pt if present; returns the optimizer steps already done."""
    payload = load(Path(cfg.run_dir) / CHECKPOINT_NAME)
    if payload is None:
        return 0
    state.backend.load_state_dict(payload["backend"])
    state.scheduler.load_state_dict(payload["scheduler"])
    state.plan.load_state_dict(payload["plan"])
    return int(payload["steps_done"])


def train(cfg: RunConfig, state: TrainState, split: Split, dataset: Dataset, loss_fn: LossFn,
          ledger: CommLedger, sink: Sink, device: torch.device, rank: int,
          on_step: Callable[[TrainState, Record], None] | None = None,
          stop: StopFlag | None = None) -> list[Record]:
    """Run optimizer steps until ``trainer.max_steps``; returns the per-step records (all ranks)."""
    dtype = torch.float64 if cfg.precision == "fp64" else None
    every_micro = cfg.accum.sync == "every_micro"
    backend, model = state.backend, state.model
    timer = StepTimer(device, ledger)  # timing sits beside the loop: phases, comm ledger, memory
    model.train()
    while state.plan.next_step < cfg.trainer.max_steps:
        timer.start_step()
        window = state.plan.window(state.plan.next_step)  # taken (next_step += 1) after the stop check
        slices = window.rank_micro_batches(split, rank)
        # One tiny all-reduce per optimizer step gives N (and the sample count) for the window.
        # Items are counted from the indices alone: micro-batches are collated one at a time
        # below, so memory does not grow with the number of accumulation steps.
        counts = torch.tensor([[dataset.count_items(ix) for ix in slices], [len(ix) for ix in slices]],
                              dtype=torch.float64, device=device)
        # The stop flag rides along, so every rank agrees to stop before the same window.
        stop_flag = torch.tensor([float(stop is not None and stop.requested)], dtype=torch.float64,
                                 device=device)
        window_counts = torch.cat([counts.sum(dim=1), stop_flag])
        dist.all_reduce(window_counts)
        # Host sync, needed for a control-flow decision; it costs nothing on GPU because the
        # previous step ended with the timer's synchronize and no work is queued yet.
        if window_counts[2] > 0:
            path = save_checkpoint(cfg, state, rank)
            raise StopRequested(window.step, path)
        state.plan.next_step += 1
        global_items = window_counts[0]
        timer.data_done()

        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for k, indices in enumerate(slices):
            boundary = k == len(slices) - 1
            timer.start_micro()
            batch = dataset.collate(indices).to(device, dtype)
            timer.batch_ready()
            with backend.sync(boundary or every_micro):
                with backend.forward_context():
                    summed = loss_fn(model(batch.inputs), batch.targets)
                if cfg.accum.loss_norm == "global_count":
                    denom = global_items  # S_rk / N: the derivation at the top of this module
                else:  # the classic loss/K with a per-micro mean, kept only to show it is wrong
                    denom = max(batch.items, 1) * split.accum_steps * split.world_size
                backend.backward(summed * (backend.grad_divisor / denom))
            loss_sum += summed.detach().to(torch.float64)
        timer.compute_done()

        grad_norm = backend.clip_grad_norm(cfg.optim.clip_norm)  # at the boundary, once per step
        lr = state.scheduler.get_last_lr()[0]
        stepped = backend.step()
        if stepped:  # a skipped fp16 step must not advance the schedule
            state.scheduler.step()
        if cfg.trainer.check_every and window.step % cfg.trainer.check_every == 0:
            check_consistency(backend, window.step + 1, Path(cfg.run_dir), record=cfg.verify.record)
        times = timer.end_step()  # on CUDA the step's one host sync; loss_sum and counts are ready after it
        # One all-gather of host floats per step for logging: loss sums and per-rank compute time
        # (the straggler view).
        per_rank = timer.gather([float(loss_sum), times.compute_s])
        items, samples = (int(v) for v in window_counts[:2].tolist())
        elapsed = times.time_s
        record: Record = {
            "step": window.step + 1,
            "epoch": window.epoch,
            "loss": float(per_rank[:, 0].sum()) / max(items, 1),
            "lr": lr,
            "samples": samples,
            "items": items,
            "micro_steps": len(slices),
            "partial_window": window.partial,
            "grad_norm": grad_norm,
            "skipped": not stepped,
            **times.as_record(),  # time_s, data_s, compute_s, optim_s, comm_*, peak_mem_bytes
            "compute_min_s": float(per_rank[:, 1].min()),
            "compute_max_s": float(per_rank[:, 1].max()),
            "samples_per_s": samples / elapsed,
            "items_per_s": items / elapsed,
        }
        state.records.append(record)
        sink.log(record)
        if on_step is not None:
            on_step(state, record)
    return state.records


def summarize(cfg: RunConfig, split: Split, records: list[Record], backend: Backend,
              run_dir: Path) -> Record:
    """The run summary, including fp64 checksums of every final parameter (collective)."""
    param_sum = torch.zeros((), dtype=torch.float64)
    param_sq = torch.zeros((), dtype=torch.float64)
    for _, tensor in backend.full_parameters():
        t = tensor.detach().to("cpu", torch.float64)
        param_sum += t.sum()
        param_sq += (t * t).sum()
    steady = records[cfg.log.warmup_steps:] or records
    total_time = sum(r["time_s"] for r in records)

    def med(key: str) -> float:
        return median(r[key] for r in steady) if steady else 0.0

    summary: dict[str, Any] = {
        "engine": cfg.engine.name,
        "model": cfg.model.name,
        "precision": cfg.precision,
        "sync": cfg.accum.sync,
        "loss_norm": cfg.accum.loss_norm,
        "world_size": split.world_size,
        "micro_batch": split.micro_batch,
        "accum_steps": split.accum_steps,
        "global_batch": split.global_batch,
        "steps": len(records),
        "final_loss": records[-1]["loss"] if records else float("nan"),
        "samples_per_s": sum(r["samples"] for r in records) / total_time if total_time else 0.0,
        "param_sum": float(param_sum),
        "param_l2": float(param_sq.sqrt()),
        "run_dir": str(run_dir),
    }
    for key in ("time_s", "data_s", "compute_s", "comm_s", "comm_exposed_s", "optim_s",
                "comm_calls", "comm_bytes", "comm_rounds"):
        summary[f"median_{key}"] = med(key)
    summary["peak_mem_bytes"] = max((r["peak_mem_bytes"] for r in records), default=0)
    busy = summary["median_compute_s"] + summary["median_comm_exposed_s"]
    summary["comm_share"] = summary["median_comm_exposed_s"] / busy if busy > 0 else 0.0
    return summary
