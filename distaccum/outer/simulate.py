"""The single-process simulator ``distaccum verify`` compares outer-synced runs with: R islands one after another.

It shares with the run the user's model factory, dataset, collate, loss and optimizer factory (and the
learning-rate schedule), like :mod:`distaccum.verify.reference`, and the sync *cadence*: which parameters form
fragment p (:func:`distaccum.outer.sync.split_fragments`) and after which steps it syncs
(:meth:`~distaccum.outer.config.OuterConfig.syncing`), so a wrong cadence would be wrong on both sides (it is
tested on its own in tests/test_outer.py). It shares none of the merge: no process group, no flat buffers, no torch
SGD for the outer step; the merge arithmetic below is written out independently. Each optimizer step t, for each island i in turn, it takes the samples island i's ranks read at step t (the
global-batch order cut for the run's split, ranks i*S .. i*S+S-1) in ONE forward/backward of

    sum(loss over those samples' items) / (their item count)

clips, and steps island i's own optimizer and schedule. After the steps at which fragment p syncs it merges p
parameter by parameter, with the weights written out:

    w_i = n_i / sum_j n_j   (n_i: island i's items since p's last sync; 1/R for weighting=equal)
    local_sgd: theta_g = sum_i w_i theta_i
    diloco:    d = sum_i w_i (theta_g - theta_i);  b = mu b + d;  theta_g -= lr (d + mu b if nesterov else b)

and every island continues from theta_g. It records island 0's loss and gradient norm every step and island 0's
parameter digests after every step (after the merge at a sync step), which is what rank 0 of the run records,
and saves island 0's final model (every island holds theta_g after the closing sync).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from distaccum.components import Components
from distaccum.config import RunConfig, to_mapping
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.data.pipeline import to_device
from distaccum.data.stream import is_stream
from distaccum.guards.tripwire import append_digests, parameter_digests
from distaccum.optim import build_optimizer, build_scheduler
from distaccum.outer.islands import IslandLayout, resolve_islands
from distaccum.outer.sync import split_fragments
from distaccum.rundir import (
    FINAL_CONFIG,
    FINAL_DIR,
    FINAL_WEIGHTS,
    Record,
    write_json,
)
from distaccum.rundir.weights import save_weights
from distaccum.split import Split
from distaccum.telemetry.sinks import JsonlSink
from distaccum.verify.reference import start_reference


def island_indices(
    order: GlobalBatchOrder, step: int, split: Split, layout: IslandLayout, island: int
) -> list[int]:
    """The sample indices island ``island``'s ranks read at 0-based ``step`` (all their micro-batches)."""
    window = order.window(step)
    return [
        int(i)
        for rank in layout.ranks(island)
        for piece in window.rank_micro_batches(split, rank)
        for i in piece.tolist()
    ]


def run_outer_reference(
    cfg: RunConfig, parts: Components, run_dir: Path, *, split: Split, seed_out: Path | None = None
) -> Record:
    """Simulate ``cfg``'s outer-synced run on ``split`` in this process; returns the summary (module docstring)."""
    if is_stream(parts.dataset):
        raise ValueError(
            "verify of outer.method runs needs a map-style dataset (a stream has no global-batch order)"
        )
    outer = cfg.outer
    layout = IslandLayout.of(split.world_size, 0, resolve_islands(outer.islands, split.world_size, 1))
    names, precision, device, first = start_reference(cfg, parts, run_dir, seed_out)
    torch.manual_seed(cfg.trainer.seed + 1_000_003)
    models = [copy.deepcopy(first).to(device) for _ in range(layout.islands)]
    params = [list(m.parameters()) for m in models]
    optimizers = [parts.optimizer(ps) if parts.optimizer else build_optimizer(ps, cfg.optim) for ps in params]
    schedulers = [
        build_scheduler(opt, cfg.optim, cfg.trainer.max_steps, global_batch=split.global_batch)
        for opt in optimizers
    ]
    theta_g = [p.detach().clone() for p in params[0]]
    momentum: list[torch.Tensor | None] = [None] * len(theta_g)
    fragments = split_fragments([p.numel() for p in params[0]], outer.fragments)  # the run's cut: a cadence
    counts = [[0.0] * outer.fragments for _ in range(layout.islands)]
    order = GlobalBatchOrder(
        len(parts.dataset),  # type: ignore[arg-type]  # map-style: it has a length
        split.global_batch,
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
    )
    collate = parts.collate or torch.utils.data.default_collate
    float_dtype = torch.float64 if precision.param_dtype == torch.float64 else None
    sink = JsonlSink(run_dir)
    records: list[Record] = []
    for model in models:
        model.train()
    for step in range(cfg.trainer.max_steps):
        rows = []
        for i, model in enumerate(models):
            samples = [parts.dataset[j] for j in island_indices(order, step, split, layout, i)]
            batch = to_device(collate(samples), device, float_dtype)
            with precision.autocast(device):
                loss_sum, n_items = parts.loss(model, batch)
            items = float(n_items)
            (loss_sum / items).backward()
            lr = schedulers[i].get_last_lr()[0]
            norm = float(torch.nn.utils.clip_grad_norm_(params[i], cfg.optim.clip_norm or math.inf))
            if math.isfinite(norm):
                optimizers[i].step()
                schedulers[i].step()
            optimizers[i].zero_grad(set_to_none=True)
            for p in range(outer.fragments):
                counts[i][p] += items
            rows.append((float(loss_sum.detach()) / items, norm, lr, items, len(samples)))
        run_samples = sum(row[4] for row in rows)
        for p in outer.syncing(step + 1, cfg.trainer.max_steps):
            merge(
                outer, fragments[p], params, theta_g, momentum, [counts[i][p] for i in range(layout.islands)]
            )
            for i in range(layout.islands):
                counts[i][p] = 0.0
        names_, numels, values = parameter_digests(models[0].named_parameters())
        append_digests(run_dir, step + 1, names_, numels, values)
        loss, norm, lr, items, samples_n = rows[0]
        record: Record = {
            "step": step + 1,
            "loss": loss,
            "lr": lr,
            "samples": samples_n,  # island 0's, like the candidate's record (docs/observability.md)
            "items": round(items),
            "run_samples": run_samples,
            "micro_steps": 1,
            "grad_norm": norm,
            "skipped": not math.isfinite(norm),
            "island_losses": [r[0] for r in rows],
        }
        records.append(record)
        sink.log(record)
    final = run_dir / FINAL_DIR
    save_weights(models[0].state_dict(), final / FINAL_WEIGHTS)
    write_json(final / FINAL_CONFIG, {**to_mapping(cfg), "components": names})
    summary: Record = {
        "reference": f"{layout.islands} islands simulated one after another in one process, each step one "
        "forward/backward per island, then the outer merge",
        "model": names["model"],
        "precision": cfg.precision,
        "world_size": 1,
        "islands": layout.islands,
        "outer": to_mapping(cfg)["outer"],
        "global_batch": split.global_batch,
        "steps": len(records),
        "final_loss": records[-1]["loss"] if records else math.nan,
        "run_dir": str(run_dir),
        "final_model": str(final),
    }
    sink.close(summary)
    return summary


@torch.no_grad()
def merge(
    outer: Any,
    fragment: list[int],
    params: Sequence[Sequence[torch.Tensor]],
    theta_g: list[torch.Tensor],
    momentum: list[torch.Tensor | None],
    counts: list[float],
) -> None:
    """Merge one fragment's parameters across the islands (module docstring), written out per parameter."""
    islands = len(params)
    total = math.fsum(counts)
    weights = (
        [1.0 / islands] * islands if outer.weighting == "equal" or total <= 0 else [n / total for n in counts]
    )
    for k in fragment:
        if outer.method == "local_sgd":
            merged = sum(weights[i] * params[i][k].detach() for i in range(islands))
            theta_g[k] = torch.as_tensor(merged).clone()
        else:
            d = sum(weights[i] * (theta_g[k] - params[i][k].detach()) for i in range(islands))
            d = torch.as_tensor(d)
            if outer.momentum:
                b = d.clone() if momentum[k] is None else outer.momentum * momentum[k] + d
                momentum[k] = b
                update = d + outer.momentum * b if outer.nesterov else b
            else:
                update = d
            theta_g[k] = theta_g[k] - outer.lr * update
        for i in range(islands):
            params[i][k].copy_(theta_g[k])
