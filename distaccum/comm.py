"""Counting and timing of gradient-reduction collectives, per optimizer step.

Engines feed the ledger from their communication hooks (DDP's ``register_comm_hook``) or from a
tap on the torch.distributed collectives they call (FSDP2, DeepSpeed). The loop marks micro-batch
and backward boundaries; the ledger turns the events into per-step counters:

- ``comm_calls`` / ``comm_bytes``: gradient collectives launched and bytes they reduced.
- ``comm_rounds``: micro-batches in which at least one gradient collective ran.
- ``comm_s``: union of the intervals during which any gradient collective was in flight.
- ``comm_exposed_s``: time the backward call kept running after the last gradient collective of
  that micro-batch was launched — i.e. communication not hidden behind gradient computation.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch


@dataclass
class CommStats:
    """Gradient-reduction counters of one optimizer step on one rank."""

    comm_calls: int = 0
    comm_bytes: int = 0
    comm_rounds: int = 0
    comm_s: float = 0.0
    comm_exposed_s: float = 0.0


class CommLedger:
    """Thread-safe accumulator: completion callbacks run on the process group's worker threads."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._stats = CommStats()
        self._micro_calls = 0
        self._last_launch = 0.0

    def start_step(self) -> None:
        """Reset counters at the start of an optimizer step."""
        with self._lock:
            self._stats = CommStats()
            self._intervals = []

    def start_micro(self) -> None:
        """Mark the start of a micro-batch (for round counting)."""
        self._micro_calls = 0

    def launched(self, tensor: torch.Tensor) -> float:
        """Record a gradient collective on ``tensor`` being launched; returns a token for completion."""
        now = time.perf_counter()
        with self._lock:
            self._stats.comm_calls += 1
            self._stats.comm_bytes += tensor.numel() * tensor.element_size()
            self._micro_calls += 1
            self._last_launch = now
        return now

    def completed(self, token: float) -> None:
        """Record the collective launched at ``token`` having finished."""
        if self.enabled:
            end = time.perf_counter()
            with self._lock:
                self._intervals.append((token, end))

    def backward_done(self, backward_end: float) -> None:
        """Called right after a micro-batch's backward returns (all its collectives are done)."""
        with self._lock:
            if self._micro_calls:
                self._stats.comm_rounds += 1
                if self.enabled:
                    self._stats.comm_exposed_s += max(0.0, backward_end - self._last_launch)

    def end_step(self) -> CommStats:
        """Counters of the step that just ended."""
        with self._lock:
            stats = self._stats
            stats.comm_s = _union_length(self._intervals) if self.enabled else 0.0
            return stats


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start  # type: ignore[operator]
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start  # type: ignore[operator]
    return total
