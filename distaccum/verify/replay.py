"""Replaying a candidate's first step under known accumulation bugs: which one reproduces what it recorded?

When a candidate's step-1 loss matches the reference (same seed weights, same samples) but its gradient
norm does not, the gradient was put together wrongly — and several wrong ways give different numbers.
This module recomputes, in this process and in fp64, every micro-batch gradient of step 1 exactly as the
candidate's split cuts the window (rank r's micro-batch k is the order's piece k x world + r), then
combines them the way each known bug would and reports the gradient norm each combination gives.
:func:`distaccum.verify.diagnosis.rule_replay` names a bug only when its norm reproduces the candidate's
within the step tolerance and the correct combination's does not: a quantitative match, not a guess.

The combinations follow how DDP and Accelerate accumulate (each rank's ``.grad`` holds ``c x world``
times its summed-loss gradients, the boundary all-reduce averages them, the step multiplies by
``1/(c N)``; c is the loop's power of two, at step 1 ``2^-round(log2 global_batch)``). Models with random
layers cannot be replayed (their masks would differ), nor streams (their windows are not indexable).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from distaccum.components import Components, build_model
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.data.pipeline import to_device
from distaccum.data.stream import is_stream
from distaccum.engines.base import Precision
from distaccum.loop import power_of_two_scale
from distaccum.models import random_layers
from distaccum.split import Split


@dataclass(frozen=True)
class Replayed:
    """One way of combining step 1's micro-batch gradients, and the gradient norm it gives."""

    name: str
    cause: str
    """The diagnosis cause (:data:`distaccum.verify.diagnosis.CAUSES`) this combination stands for."""
    message: str
    grad_norm: float


@dataclass
class MicroGradients:
    """Step 1's gradients of the summed loss, per rank and micro-batch: ``grads[r][k]`` (flat, fp64)."""

    grads: list[list[torch.Tensor]]
    items: list[list[float]]
    samples: list[list[int]]

    @property
    def total_items(self) -> float:
        return sum(sum(row) for row in self.items)


def micro_gradients(
    parts: Components,
    split: Split,
    seed: int,
    weights: Path,
    model_name: str,
    *,
    shuffle: bool,
    drop_last: bool,
) -> MicroGradients | None:
    """Every (rank, micro-batch) gradient of step 1 from the seed weights (the order of ``trainer.seed``,
    ``data.shuffle``, ``data.drop_last``), or None when the model draws random numbers or the data is a stream."""
    if is_stream(parts.dataset):
        return None
    order = GlobalBatchOrder(
        len(parts.dataset),  # type: ignore[arg-type]  # map-style: it has a length
        split.global_batch,
        seed=seed,
        shuffle=shuffle,
        drop_last=drop_last,
    )
    model = build_model(parts.model, seed, Precision.of("fp64"), str(weights), model_name)
    if random_layers(model):
        return None
    model.train()
    collate = parts.collate or torch.utils.data.default_collate
    window = order.window(0)
    params = [p for p in model.parameters() if p.requires_grad]
    grads: list[list[torch.Tensor]] = []
    items: list[list[float]] = []
    samples: list[list[int]] = []
    for rank in range(split.world_size):
        grads.append([])
        items.append([])
        samples.append([])
        for piece in window.rank_micro_batches(split, rank):
            if not len(piece):  # an empty piece trains with weight 0: it adds nothing
                grads[-1].append(torch.zeros(sum(p.numel() for p in params), dtype=torch.float64))
                items[-1].append(0.0)
                samples[-1].append(0)
                continue
            model.zero_grad(set_to_none=True)
            batch = to_device(
                collate([parts.dataset[int(i)] for i in piece]), torch.device("cpu"), torch.float64
            )
            summed, n_items = parts.loss(model, batch)
            summed.backward()
            grads[-1].append(
                torch.cat(
                    [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                )
                .detach()
                .clone()
            )
            items[-1].append(float(n_items))
            samples[-1].append(len(piece))
    return MicroGradients(grads, items, samples)


def _clip(vector: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``clip_grad_norm_`` does to a gradient."""
    return vector * min(1.0, max_norm / (float(vector.norm()) + 1e-6))


def _from(start: int, weight: float, r: int, k: int) -> float:
    """``weight`` for micro-batches ``start`` and later, 0 before (``r``, the rank, does not matter)."""
    return weight if k >= start else 0.0


def combinations(
    m: MicroGradients, split: Split, clip_norm: float | None, every_micro: bool = False
) -> list[Replayed]:
    """The correct combination first, then every known wrong one (only those that differ from it).
    ``every_micro``: the candidate reduces every micro-batch (``accum.sync=every_micro``)."""
    world, k_steps = split.world_size, split.accum_steps
    n = m.total_items
    flat = [g for row in m.grads for g in row]

    def total(select: Callable[[int, int], float]) -> torch.Tensor:
        return sum(select(r, k) * m.grads[r][k] for r in range(world) for k in range(k_steps))  # type: ignore[return-value]

    out = [
        Replayed(
            "correct",
            "correct",
            "every micro-batch gradient summed, divided by the global item count",
            float(total(lambda r, k: 1.0 / n).norm()),
        )
    ]
    out.append(
        Replayed(
            "mean_per_micro",
            "loss_normalization",
            f"each micro-batch is normalised by its own item count and the window by its "
            f"{k_steps * world} micro-batches (loss/K, the per-micro-batch mean)",
            float(
                total(
                    lambda r, k: 1.0 / (max(m.items[r][k], 1.0) * k_steps * world) if m.samples[r][k] else 0.0
                ).norm()
            ),
        )
    )
    out.append(
        Replayed(
            "per_rank_count",
            "loss_normalization",
            "each rank is normalised by its own item count, then the ranks averaged",
            float(total(lambda r, k: 1.0 / (max(sum(m.items[r]), 1.0) * world)).norm()),
        )
    )
    for start in range(1, k_steps):
        out.append(
            Replayed(
                f"lost_before_{start + 1}",
                "lost_gradients",
                f"the accumulated gradients are wiped before micro-batch {start + 1} of {k_steps}: "
                f"only micro-batches {start + 1}..{k_steps} reach the step",
                float(total(functools.partial(_from, start, 1.0 / n)).norm()),
            )
        )
    if clip_norm is not None and flat:
        out.append(clip_per_micro(m, split, clip_norm, every_micro))
    correct = out[0].grad_norm
    return [out[0]] + [
        h for h in out[1:] if not math.isclose(h.grad_norm, correct, rel_tol=1e-9, abs_tol=0.0)
    ]


def clip_per_micro(m: MicroGradients, split: Split, clip_norm: float, every_micro: bool) -> Replayed:
    """The clip run after every micro-batch instead of once at the step: on each rank's partial local accumulation
    (DDP's and Accelerate's ``no_sync`` window), or with ``every_micro`` on the reduced accumulation, where each
    micro-batch is reduced as it comes (a step transform in a per-micro-batch reduce path: ZeRO-3 ran Muon's there,
    DeepSpeed #8443). Either way the last clip sees the reduced gradient and the step measures the norm after it."""
    world, k_steps, n = split.world_size, split.accum_steps, m.total_items
    # What each rank's .grad (or partition) holds per unit of summed-loss gradient: c (the engines' grad_divisor
    # undoes what their backward or reduction divides by); a reduction sums the ranks' accumulations.
    c = power_of_two_scale(0.0, split.global_batch)
    if every_micro:
        acc = torch.zeros_like(m.grads[0][0])
        for k in range(k_steps):
            acc = _clip(acc + c * torch.stack([m.grads[r][k] for r in range(world)]).sum(dim=0), clip_norm)
        where = "the reduced accumulation after every micro-batch's reduction (a step transform in a per-micro-batch "
        where += "reduce path, as ZeRO-3 ran Muon's in DeepSpeed #8443)"
        return Replayed(
            "clip_per_micro",
            "clipping",
            f"the clip to {clip_norm:g} runs on {where} instead of once on the window's gradient",
            float(acc.norm()) / (c * n),
        )
    ranks: list[torch.Tensor] = []
    for r in range(world):
        acc = torch.zeros_like(m.grads[r][0])
        for k in range(k_steps - 1):
            acc = _clip(acc + c * m.grads[r][k], clip_norm)
        ranks.append(acc + c * m.grads[r][k_steps - 1])
    reduced = _clip(torch.stack(ranks).sum(dim=0), clip_norm)
    message = (
        f"clip_grad_norm_(max_norm={clip_norm:g}) is applied after every micro-batch's backward, to the "
        "partial accumulation, instead of once to the window's reduced gradient"
    )
    return Replayed("clip_per_micro", "clipping", message, float(reduced.norm()) / (c * n))
