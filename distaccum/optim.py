"""Optimizer and learning-rate schedule, both advanced once per optimizer step (never per micro-batch).

The schedule multiplies the optimizer's lr by ``OptimConfig.lr_scale`` (``optim.lr_scaling``: the effective
batch's share of ``optim.base_batch``, linearly or by its square root) and by the warmup/decay
factor of the step, so records' ``lr`` is the learning rate actually applied.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

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


class LrSchedule:
    """The multiplier of ``optim.lr`` at 0-based optimizer step ``s``: ``lr_scale`` x linear warmup, then the decay.

    A fresh run has one segment: the decay runs from 1 after warmup to ``min_lr_ratio`` at its horizon,
    ``trainer.max_steps``. A resume that moves the horizon of a decaying schedule must say how
    (``trainer.schedule_on_resume``): ``keep`` leaves the segments as they are (past the old horizon the
    multiplier stays at its final value); ``stretch`` appends a segment that decays from the multiplier
    reached at the resumed step to ``min_lr_ratio`` at the new horizon, so the learning rate never jumps.
    The attributes are plain JSON values: LambdaLR saves a callable object's ``__dict__`` in its state dict,
    so a checkpoint carries the schedule the run actually followed and a later resume keeps it.
    """

    def __init__(self, cfg: OptimConfig, total_steps: int, scale: float | list[list[float]] = 1.0) -> None:
        self.kind = cfg.schedule
        self.warmup = cfg.warmup_steps
        self.floor = cfg.min_lr_ratio
        self.scales: list[list[float]] = scale if isinstance(scale, list) else [[0, scale]]
        """``[first step, lr_scale]``, in order: a growing batch's phases each scale the lr by their global
        batch (``optim.lr_scaling``); one phase otherwise."""
        self.segments: list[list[float]] = [[0, total_steps, 1.0]]
        """``[first step, horizon, multiplier at the first decaying step]``, in order."""

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LrSchedule:
        """The schedule a scheduler's state dict saved (its ``lr_lambdas[0]``; before batch growth, one
        ``scale``)."""
        schedule = cls.__new__(cls)
        schedule.__dict__.update(state)
        if "scale" in state:
            schedule.scales = [[0, schedule.__dict__.pop("scale")]]
        return schedule

    @property
    def horizon(self) -> int:
        """The step count at which the multiplier reaches its final value."""
        return int(self.segments[-1][1])

    def factor(self, step: int) -> float:
        """The warmup/decay multiplier (without ``scale``) at 0-based optimizer step ``step``."""
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.kind == "constant":
            return 1.0
        first, horizon, top = next(s for s in reversed(self.segments) if s[0] <= step)
        begin = max(int(first), self.warmup)
        progress = min((step - begin) / max(int(horizon) - begin - 1, 1), 1.0)
        shape = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.floor + (top - self.floor) * shape

    def scale(self, step: int) -> float:
        """``lr_scale`` of the global batch of 0-based step ``step``."""
        return next(s for first, s in reversed(self.scales) if first <= step)

    def __call__(self, step: int) -> float:
        return self.scale(step) * self.factor(step)

    def stretch(self, step: int, horizon: int) -> None:
        """From optimizer step ``step`` on, decay from the multiplier reached there to the final value at
        ``horizon`` (a resume with ``trainer.schedule_on_resume=stretch``)."""
        if step <= self.warmup:  # the decay has not begun: it simply spans the new horizon
            self.segments = [[0, horizon, 1.0]]
        else:
            self.segments.append([step, horizon, self.factor(step)])


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Multiplier of ``cfg.lr`` for 0-based optimizer step ``step`` of a fresh run: linear warmup, then decay."""
    return LrSchedule(cfg, total_steps).factor(step)


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    cfg: OptimConfig,
    total_steps: int,
    *,
    global_batch: int,
    batches: list[list[int]] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR of :class:`LrSchedule` (``lr_scale x`` warmup/decay) for an effective batch of
    ``global_batch`` samples, or per phase ``[first step, global batch]`` of ``batches`` (a growing batch); the
    loop calls ``step()`` once per optimizer step."""
    phases = batches if batches is not None else [[0, global_batch]]
    scales = [[first, cfg.lr_scale(batch)] for first, batch in phases]
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LrSchedule(cfg, total_steps, scales))


def rescale(
    scheduler: torch.optim.lr_scheduler.LambdaLR, first: int, global_batch: int, cfg: OptimConfig
) -> None:
    """From 0-based step ``first`` on the lr follows ``global_batch`` (``optim.lr_scaling``; the adaptive batch's
    change). The scheduler already computed the lr of step ``first`` (its ``step()`` ran): it is recomputed."""
    schedule = schedule_of(scheduler)
    if schedule is None:
        return
    schedule.scales.append([first, cfg.lr_scale(global_batch)])
    for group, base in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, strict=True):
        group["lr"] = base * schedule(scheduler.last_epoch)
    scheduler._last_lr = [
        group["lr"] for group in scheduler.optimizer.param_groups
    ]  # what get_last_lr() reads


def schedule_of(scheduler: Any) -> LrSchedule | None:
    """The :class:`LrSchedule` driving ``scheduler`` (None for a user's own scheduler)."""
    lambdas = getattr(scheduler, "lr_lambdas", None) or [None]
    return lambdas[0] if isinstance(lambdas[0], LrSchedule) else None
