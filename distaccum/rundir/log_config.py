"""What each step's record goes to and holds: ``log.*`` (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports it and re-exports :class:`LogConfig`) to keep that module
under 500 lines; like :mod:`distaccum.batching.config` it imports nothing of distaccum. The record itself:
docs/observability.md.
"""

from __future__ import annotations

from dataclasses import dataclass


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"log.{name}={value!r} is not one of {', '.join(allowed)}")


@dataclass(kw_only=True)
class LogConfig:
    """Where per-step records go. JSONL in run_dir is always written."""

    console: str = "bar"
    """bar: a progress bar on a terminal, a progress line per step otherwise; quiet: only the summary."""
    wandb: bool = False
    """Also log to Weights & Biases (rank 0 only)."""
    wandb_mode: str = "offline"
    """offline (default, no account or network needed) | online (needs WANDB_API_KEY or a netrc
    entry; without one it warns and logs offline) | disabled (no wandb even with log.wandb=true)."""
    wandb_project: str = "distaccum"
    """wandb project name."""
    ledger: bool = True
    """Time compute vs communication per step (the comm/compute ledger)."""
    grad_norm: bool = True
    """Record each step's global gradient norm (grad_norm; one read pass over the gradients, which clipping needs
    too). false: no such pass when nothing clips (optim.clip_norm=null): grad_norm is recorded as null and a step is
    skipped for a non-finite loss only, not for a gradient that overflowed from a finite loss. distaccum verify
    always records it."""
    warmup_steps: int = 1
    """Steps excluded from summary medians (first-step compile/allocation noise)."""
    rank_stats_every: int = 10
    """Record every rank's compute time (compute_min_s / compute_max_s: the straggler view) every N
    optimizer steps; it costs one small all-gather (0: never)."""
    gns: bool = False
    """Log the gradient noise scale per step (gns, gns_smoothed; McCandlish et al. 2018), estimated
    from each rank's accumulated gradient and the reduced one as the DDP comm hook sees them: no extra
    passes; two squared norms of the gradient and one all-reduce of three numbers per step.
    Engines whose comm hook measures it (engine=ddp), accum.sync=boundary and more than one rank only."""
    gns_ema: float = 0.95
    """Smoothing of gns_smoothed: exponential moving averages of the |G|^2 and tr(Sigma) estimates with
    this decay per step (about 1/(1 - gns_ema) steps), then their ratio."""

    def __post_init__(self) -> None:
        _choice("console", self.console, ("bar", "quiet"))
        if self.rank_stats_every < 0:
            raise ValueError(f"log.rank_stats_every must be >= 0, got {self.rank_stats_every}")
        if not 0.0 <= self.gns_ema < 1.0:
            raise ValueError(f"log.gns_ema must be in [0, 1), got {self.gns_ema}")
        _choice("wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))
