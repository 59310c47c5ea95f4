"""Preemption-safe checkpoints at window boundaries.

A stop request (SIGTERM from torchrun/Slurm, or SIGUSR1 sent ahead of a time limit) is only acted
on between optimizer steps: the window in progress is finished and stepped, never dropped half-way,
and the checkpoint holds the plan position, so a requeued job resumes at the exact next sample with
the same model, optimizer, scheduler and scaler state.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import FrameType
from typing import Any

import torch

EXIT_REQUEUE = 3
"""Exit code of a worker that stopped on request after checkpointing (the job should be requeued)."""


class StopFlag:
    """Set by SIGTERM/SIGUSR1; the loop all-reduces it so every rank stops after the same window."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None

    def install(self) -> None:
        """Handle SIGTERM and SIGUSR1 in this (main) thread by setting the flag."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name


class StopRequested(Exception):
    """Raised by the loop after a checkpoint was written because a stop was requested."""

    def __init__(self, step: int, path: Path) -> None:
        super().__init__(f"stopped on request after optimizer step {step}; checkpoint {path}")
        self.step = step
        self.path = path


def save(path: Path, state: dict[str, Any]) -> None:
    """Atomic write: a preempted save never leaves a truncated checkpoint behind."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load(path: Path) -> dict[str, Any] | None:
    """The checkpoint at ``path``, or None when there is none."""
    if not path.is_file():
        return None
    return torch.load(path, map_location="cpu", weights_only=False)
