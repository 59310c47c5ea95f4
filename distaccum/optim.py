"""Optimizer and learning-rate schedule, both advanced once per optimizer step (never per micro-batch).

The schedule multiplies the optimizer's lr by ``OptimConfig.lr_scale`` (``optim.lr_scaling``: the effective
batch's share of ``optim.base_batch``, linearly or by its square root) and by the warmup/decay
factor of the step, so records' ``lr`` is the learning rate actually applied.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from distaccum.config import OptimConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """SGD (momentum, L2 weight decay) or AdamW (decoupled weight decay)."""
    params = list(params)
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    # foreach=False: the per-parameter path rounds identically whether parameters are whole
    # (DDP, reference) or sharded (FSDP), which keeps split comparisons tight.
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay, foreach=False)


def describe_lr(cfg: OptimConfig, global_batch: int, base_lr: float) -> str:
    """One line stating the effective learning rate and where it comes from (printed at start)."""
    effective = base_lr * cfg.lr_scale(global_batch)
    if cfg.lr_scaling == "none":
        return f"lr {effective:.4g} (optim.lr_scaling=none)"
    ratio = f"{global_batch}/{cfg.base_batch}"
    factor = ratio if cfg.lr_scaling == "linear" else f"sqrt({ratio})"
    return (
        f"effective lr {effective:.4g} = {base_lr:.4g} x {factor} (optim.lr_scaling={cfg.lr_scaling}: global batch "
        f"{global_batch}, optim.base_batch {cfg.base_batch}); warmup {cfg.warmup_steps} optimizer steps"
    )


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for 0-based optimizer step ``step``: linear warmup, then decay."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.schedule == "constant":
        return 1.0
    span = max(total_steps - cfg.warmup_steps - 1, 1)
    progress = min((step - cfg.warmup_steps) / span, 1.0)
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, *, global_batch: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR of ``lr_scale x`` :func:`lr_factor` for an effective batch of ``global_batch``
    samples; the loop calls ``step()`` once per optimizer step."""
    scale = cfg.lr_scale(global_batch)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: scale * lr_factor(s, cfg, total_steps))
