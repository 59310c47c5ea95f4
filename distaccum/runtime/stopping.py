"""Stopping on request: SIGTERM (torchrun, Slurm preemption) or SIGUSR1 (ahead of a time limit).

A request is only acted on between optimizer steps: every rank learns of it in the window's one
all-reduce, finishes and steps the window in progress, writes a checkpoint and stops.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType

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

    def __init__(self, step: int, path: Path | None) -> None:
        super().__init__(
            f"stopped on request after optimizer step {step}; "
            + (f"checkpoint {path}" if path is not None else "no checkpoint written")
        )
        self.step = step
        self.path = path
