"""The independent reference ``distaccum verify`` compares every run with: plain PyTorch, one process.

It shares only the user's model factory, dataset, collate, loss and optimizer factory (and the
learning-rate schedule) with the run it checks — no engine wrapper, no process group, no
accumulation loop, no gradient scaling. Each optimizer step takes the whole window the order gives
that step (for a stream: the next ``global_batch`` samples read off it), runs ONE forward/backward of

    sum(loss over the window's items) / (the window's item count)

clips with ``torch.nn.utils.clip_grad_norm_`` and steps the optimizer. A mistake that does not
depend on the split (a wrong constant in the normalization, a gradient divided by the world size
twice, a partial window divided by the nominal batch) therefore shows up as a difference from this
reference, which split-against-split comparisons cannot see.

It writes the same files as a training run (``metrics.jsonl`` with loss and grad_norm per step,
``param_digests.jsonl``, ``final/model.safetensors``, ``summary.json``), so :func:`distaccum.verify.compare`
reads both alike.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any

import torch

from distaccum.batching.growth import BatchGrowth
from distaccum.components import Components, build_model
from distaccum.config import RunConfig, to_mapping
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.data.pipeline import to_device
from distaccum.data.stream import is_stream, stream_windows
from distaccum.engines.base import Precision
from distaccum.guards.tripwire import append_digests, parameter_digests
from distaccum.models import batch_stat_layers, random_layers
from distaccum.optim import build_optimizer, build_scheduler
from distaccum.rundir import (
    CONFIG,
    FINAL_CONFIG,
    FINAL_DIR,
    FINAL_WEIGHTS,
    METRICS,
    OLD_PARAM_DIGESTS,
    PARAM_DIGESTS,
    Record,
    write_json,
)
from distaccum.rundir.weights import save_weights
from distaccum.telemetry.sinks import JsonlSink


def window_samples(
    cfg: RunConfig, parts: Components, global_batch: int
) -> Iterator[tuple[int, list[Any], bool]]:
    """(epoch, samples, partial) of each optimizer step's window, as a run's source serves them: from the
    global-batch order (map-style) or read off the stream in order (:mod:`distaccum.data.stream`)."""
    if is_stream(parts.dataset):
        for window in stream_windows(
            parts.dataset,
            global_batch,
            drop_last=cfg.data.drop_last,
            num_workers=cfg.data.num_workers,
            prefetch_factor=cfg.data.prefetch_factor,
        ):
            yield window.epoch, window.samples, len(window.samples) < global_batch
        return
    order = GlobalBatchOrder(
        len(parts.dataset),  # type: ignore[arg-type]  # map-style: it has a length
        global_batch,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
        growth=ramp_of(cfg, global_batch),
    )
    for step in count():
        window_of_step = order.window(step)
        yield (
            window_of_step.epoch,
            [parts.dataset[int(i)] for i in window_of_step.indices],
            window_of_step.partial,
        )


def ramp_of(cfg: RunConfig, global_batch: int) -> BatchGrowth | None:
    """``accum.ramp``'s global batch per step (None: constant): each step's window is taken whole all the same."""
    return BatchGrowth.of(cfg.accum.ramp, global_batch) if cfg.accum.ramp.enabled else None


def start_reference(
    cfg: RunConfig, parts: Components, run_dir: Path, seed_out: Path | None
) -> tuple[dict[str, str], Precision, torch.device, torch.nn.Module]:
    """What every reference starts with: its run directory (no stale records, the config), its precision and device,
    and the model built exactly as a training run builds it (seed, precision, ``init_from``), saved first to
    ``seed_out`` when given (the seed checkpoint other runs start from). Returns (component names, precision, device,
    the model on the CPU)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (METRICS, PARAM_DIGESTS, OLD_PARAM_DIGESTS):
        (run_dir / stale).unlink(missing_ok=True)
    names = parts.describe()
    write_json(run_dir / CONFIG, {**to_mapping(cfg), "components": names})
    precision = Precision.of(cfg.precision)
    device = torch.device("cuda" if cfg.trainer.device != "cpu" and torch.cuda.is_available() else "cpu")
    model = build_model(parts.model, cfg.trainer.seed, precision, cfg.trainer.init_from, names["model"])
    if seed_out is not None:
        save_weights(model.state_dict(), seed_out)
    return names, precision, device, model


def run_reference(
    cfg: RunConfig, parts: Components, run_dir: Path, *, global_batch: int, seed_out: Path | None = None
) -> Record:
    """Train ``cfg.trainer.max_steps`` plain steps of ``global_batch`` samples; returns the summary.

    The model is built exactly as a training run builds it (seed, precision, ``init_from``);
    ``seed_out`` saves those initial weights first (the seed checkpoint other runs start from).
    """
    names, precision, device, model = start_reference(cfg, parts, run_dir, seed_out)
    facts = {"batch_stat_layers": batch_stat_layers(model), "random_layers": random_layers(model)}
    torch.manual_seed(cfg.trainer.seed + 1_000_003)  # what rank 0 of a run draws from (dropout)
    model = model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = parts.optimizer(params) if parts.optimizer else build_optimizer(params, cfg.optim)
    ramp = ramp_of(cfg, global_batch)
    batches = [list(p) for p in ramp.phases] if ramp is not None else None
    scheduler = build_scheduler(
        optimizer, cfg.optim, cfg.trainer.max_steps, global_batch=global_batch, batches=batches
    )
    collate = parts.collate or torch.utils.data.default_collate
    float_dtype = torch.float64 if precision.param_dtype == torch.float64 else None
    sink = JsonlSink(run_dir)
    records: list[Record] = []
    model.train()
    windows = window_samples(cfg, parts, global_batch)
    for step in range(cfg.trainer.max_steps):
        epoch, samples, partial = next(windows)
        batch = to_device(collate(samples), device, float_dtype)
        with precision.autocast(device):
            loss_sum, n_items = parts.loss(model, batch)
        items = float(n_items)
        (loss_sum / items).backward()  # the whole window at once: sum over its items / their count
        lr = scheduler.get_last_lr()[0]
        norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.optim.clip_norm or math.inf))
        applied = math.isfinite(norm)
        if applied:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        names_, numels, values = parameter_digests(model.named_parameters())
        append_digests(run_dir, step + 1, names_, numels, values)
        record: Record = {
            "step": step + 1,
            "epoch": epoch,
            "loss": float(loss_sum.detach()) / items,
            "lr": lr,
            "samples": len(samples),
            "items": round(items),
            "global_batch": ramp.global_batch(step) if ramp is not None else global_batch,
            "micro_steps": 1,
            "partial_window": partial,
            "grad_norm": norm,
            "skipped": not applied,
        }
        records.append(record)
        sink.log(record)
    final = run_dir / FINAL_DIR
    save_weights(model.state_dict(), final / FINAL_WEIGHTS)
    write_json(final / FINAL_CONFIG, {**to_mapping(cfg), "components": names})
    flat = torch.cat([p.detach().double().flatten().cpu() for p in model.parameters()])
    summary: Record = {
        "reference": "plain PyTorch, one process, one forward/backward per window",
        "model": names["model"],
        "precision": cfg.precision,
        "world_size": 1,
        "micro_batch": global_batch,
        "accum_steps": 1,
        "global_batch": global_batch,
        "steps": len(records),
        "final_loss": records[-1]["loss"] if records else math.nan,
        "param_sum": float(flat.sum()),
        "param_l2": float(flat.norm()),
        "run_dir": str(run_dir),
        "final_model": str(final),
        **facts,
    }
    sink.close(summary)  # also writes summary.json
    return summary
