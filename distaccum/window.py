"""The window's totals: what each rank's K micro-batches add up to, and the ONE collective that tells every rank.

The loop normalizes by N, the global item count of the optimizer step's window (:mod:`distaccum.loop` has the math).
Each micro-batch's loss returns its summed loss S_k and item count n_k; :class:`WindowTotals` keeps them as they
came (no operation per micro-batch) and, once the window's last forward has run, sends one row per rank in one
all-gather of the run's own process group (gloo or NCCL), launched before the last backward so that it overlaps it:

    row = [S_1 .. S_K, n_1 .. n_K, stop, checkpoint, *carried]

``stop`` and ``checkpoint`` are this rank's votes (a stop was requested; a time-based checkpoint is due); ``carried``
is what a check sends along so that it needs no collective of its own (:class:`Carry`: the reduction fingerprint's
previous step). Every rank then holds every row and computes the same totals from them on the host, in float64 and
in rank order (:class:`WindowResult`): N is exact (item counts are integers below 2^53), the loss sum is the same
number on every rank, and a rank whose loss was not finite is named. On CUDA reading the rows is one wait for the
device per step, after the last backward was queued.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distaccum.runtime.procgroup import all_gather_into


@dataclass(frozen=True)
class Carry:
    """What a check sends with the window's collective: host numbers and a flat tensor on the run's device."""

    floats: list[float]
    tensor: torch.Tensor | None = None


@dataclass(frozen=True)
class WindowResult:
    """The window's totals over every rank (identical on every rank)."""

    items: float
    """N: the window's loss items over all ranks (of the window's group: an outer-synced run's island)."""
    samples: int
    """The window's real samples over the same ranks (stand-ins of empty pieces not counted)."""
    loss_sum: float
    bad_ranks: list[int]
    """Ranks whose loss was not finite."""
    stop_votes: int
    checkpoint_votes: int
    items_min: float
    """The smallest and largest micro-batch item count over every rank's micro-batches."""
    items_max: float
    rank_sums: list[tuple[float, float]]
    """Each rank's own (loss sum, item count), in rank order."""
    carried: list[list[float]]
    """Each rank's carried values (:class:`Carry`: its floats, then its tensor's elements), in rank order."""

    def grad_scale(self, c: float, loss_norm: str = "global_count") -> float:
        """The factor the reduced gradient is multiplied by: 1/(c N) (``mean_per_micro``: 1/c, the loss carried the
        rest). c N is exact (c is a power of two), so this is one rounding. NaN when some rank's loss was not finite,
        so every engine's check of the gradient skips the update on every rank alike."""
        if self.bad_ranks:
            return math.nan
        return 1.0 / (c * max(self.items, 1.0)) if loss_norm == "global_count" else 1.0 / c


class WindowTotals:
    """One rank's micro-batch sums for the current window, and the window's collective (one per optimizer step).

    :meth:`add` each micro-batch, :meth:`reduce` before the last backward, :meth:`read` after it; :meth:`start`
    begins the next window. The buffers the row and the gathered rows pass through are kept from window to window.
    """

    def __init__(self, device: torch.device, group: Any = None) -> None:
        self.device = device
        self.group = group
        """The group whose ranks share the window (None: the world; an outer-synced run's island)."""
        self.world = dist.get_world_size(group)
        self._cuda = device.type == "cuda"
        self._host: torch.Tensor | None = None
        """The row's host numbers (pinned on CUDA), written through a NumPy view: no operator per number."""
        self._host_np: Any = None
        self._gathered: torch.Tensor | None = None
        """Every rank's row, rank after rank, on the device (kept: the same size every window)."""
        self._rows_np: Any = None
        """A NumPy view of the gathered rows on the host (of ``_gathered`` on the CPU; a pinned copy on CUDA)."""
        self._rows_host: torch.Tensor | None = None
        self.start()

    def start(self) -> None:
        """Begin a window: nothing counted, no collective under way."""
        self._losses: list[torch.Tensor] = []
        self._counts: list[torch.Tensor | float] = []
        self._samples = 0
        self._versions: list[tuple[torch.Tensor, int]] = []
        self._work: Any = None
        self._row: torch.Tensor | None = None
        self._result: WindowResult | None = None

    def add(self, summed: torch.Tensor, n_items: torch.Tensor | int | float, samples: int) -> float:
        """Keep one micro-batch's summed loss and item count as they came; returns the weight its loss is
        backpropagated with: 1, or 0 for a stand-in sample (``samples`` 0: an empty piece of a partial window,
        trained so that every rank runs K backwards), which counts nothing but still shows a non-finite loss."""
        if samples:
            self._samples += samples
            self._losses.append(summed)
            self._counts.append(n_items)
            if isinstance(
                n_items, torch.Tensor
            ):  # read at reduce(): it must still hold this micro-batch's count
                self._versions.append((n_items, n_items._version))
            return 1.0
        with torch.no_grad():
            self._losses.append(summed * 0.0)  # +-0, or NaN
        self._counts.append(0.0)
        return 0.0

    def reduce(self, *, stop: bool, checkpoint: bool, carry: Carry | None = None) -> None:
        """Launch the window's collective (asynchronous: the last backward overlaps it)."""
        counts = self._counts
        changed = [i for i, (n, version) in enumerate(self._versions) if n._version != version]
        if changed:
            raise ValueError(
                "the loss returned an item count tensor and changed it in place afterwards (a buffer it "
                "reuses): distaccum reads the window's counts once, after its last forward, so each "
                "micro-batch's count must stay as returned; return a fresh tensor (n.clone()) or an int"
            )
        tensors = bool(self._versions)
        host = [] if tensors else [float(n) for n in counts]  # exact: integer counts below 2^53, or floats
        host += [
            float(self._samples),
            float(stop),
            float(checkpoint),
            *(carry.floats if carry is not None else []),
        ]
        with torch.no_grad():  # the losses still hold their graphs (their backwards may not have run)
            pieces = [torch.stack(self._losses)]
            if tensors:  # counts the loss returned as tensors: stacked on the device, read with the rest
                pieces.append(torch.stack([self._on_device(n) for n in counts]))
            pieces.append(self._host_numbers(host))
            if carry is not None and carry.tensor is not None:
                pieces.append(carry.tensor)
            row = torch.cat(pieces)  # float64: cat promotes the losses and counts, exactly
        if self.world == 1:  # no peer: this rank's row is every row
            self._row = row
            return
        if self._gathered is None or self._gathered.numel() != self.world * row.numel():
            self._gathered = torch.empty(self.world * row.numel(), dtype=torch.float64, device=self.device)
            self._rows_host = (
                torch.empty(self._gathered.shape, dtype=torch.float64, pin_memory=True)
                if self._cuda
                else self._gathered
            )
            self._rows_np = self._rows_host.numpy()
        self._work = all_gather_into(self._gathered, row, async_op=True, group=self.group)

    def _on_device(self, n: torch.Tensor | float) -> torch.Tensor:
        if not isinstance(n, torch.Tensor):
            return torch.tensor(float(n), dtype=torch.float64, device=self.device)
        return n if n.device == self.device else n.to(self.device)

    def _host_numbers(self, values: list[float]) -> torch.Tensor:
        """``values`` as a float64 tensor on the device, through the kept host buffer (from pinned memory on CUDA,
        without waiting: the previous window's copy was read long ago)."""
        if self._host is None or len(self._host_np) != len(values):
            self._host = torch.empty(len(values), dtype=torch.float64, pin_memory=self._cuda)
            self._host_np = self._host.numpy()
        self._host_np[:] = values
        return self._host.to(self.device, non_blocking=True) if self._cuda else self._host

    def read(self) -> WindowResult:
        """Wait for every rank's row and compute the window's totals (once per window; on CUDA the host waits here
        for the device, once)."""
        if self._result is None:
            self._result = self._totals(self._flat())
        return self._result

    def _flat(self) -> list[float]:
        if self.world == 1:
            assert self._row is not None, "reduce() launches the window's collective first"
            return self._row.tolist()
        assert self._work is not None and self._gathered is not None, (
            "reduce() launches the window's collective first"
        )
        self._work.wait()
        if self._cuda:
            assert self._rows_host is not None
            self._rows_host.copy_(self._gathered)  # the one wait for the device
        return self._rows_np.tolist()

    def _totals(self, flat: list[float]) -> WindowResult:
        k, width = len(self._losses), len(flat) // self.world
        rows = [flat[r * width : (r + 1) * width] for r in range(self.world)]
        sums = [
            (math.fsum(row[:k]) if all(map(math.isfinite, row[:k])) else math.nan, sum(row[k : 2 * k]))
            for row in rows
        ]
        counts = [n for row in rows for n in row[k : 2 * k]]
        return WindowResult(
            items=sum(n for _, n in sums),
            loss_sum=sum(s for s, _ in sums),
            bad_ranks=[r for r, (s, _) in enumerate(sums) if not math.isfinite(s)],
            samples=sum(int(row[2 * k]) for row in rows),
            stop_votes=sum(int(row[2 * k + 1]) for row in rows),
            checkpoint_votes=sum(int(row[2 * k + 2]) for row in rows),
            items_min=min(counts),
            items_max=max(counts),
            rank_sums=sums,
            carried=[row[2 * k + 3 :] for row in rows],
        )
