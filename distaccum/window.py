"""The window's totals: its running sums on each rank (loss, item count, flags) and its ONE collective.

Where the loop's N, the global item count of an optimizer step's window, comes from (:mod:`distaccum.loop` has
the math): every rank adds each micro-batch's summed loss and item count, and after the last forward one
collective gives the sums over all ranks, with the flags every rank must agree on and the rows a check carries
(:meth:`WindowTotals.carry`). :class:`DeviceTotals` keeps the sums on an accelerator and all-reduces them;
:class:`HostTotals`, the CPU's, keeps Python floats and exchanges each rank's numbers
(:mod:`distaccum.cluster.exchange`: Unix sockets between the ranks of one host, gloo's all-gather otherwise).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from distaccum.cluster.exchange import GlooExchange, Pending, RowExchange
from distaccum.split import Split


def item_count(n_items: torch.Tensor | int | float, device: torch.device) -> torch.Tensor:
    """A micro-batch's loss-item count as a fresh float64 scalar on ``device``, without a host sync: a
    Python number is filled in on the device (``torch.tensor(n, device=cuda)`` would copy and wait); a
    tensor is copied even when it is float64 there already (the window keeps the counts, and the loss's
    own tensor may be a buffer it reuses)."""
    if isinstance(n_items, torch.Tensor):
        return n_items.to(device, torch.float64, non_blocking=True, copy=True)
    return torch.full((), float(n_items), dtype=torch.float64, device=device)


@dataclass(frozen=True)
class WindowResult:
    """The window's all-reduced totals, read on the host once per step (identical on every rank)."""

    items: float
    """N: the window's loss items over all ranks."""
    loss_sum: float
    bad_ranks: list[int]
    """Ranks whose loss was not finite."""
    stop_votes: float
    checkpoint_votes: float
    items_min: float
    """The smallest and largest micro-batch item count over every rank's micro-batches."""
    items_max: float


class WindowTotals(ABC):
    """The window's running sums on this rank, and its ONE collective (:meth:`for_device` picks where they live).

    The all-reduced tensor: N, the loss sum, and flags every rank must agree on (a non-finite loss on
    some rank, a stop request, a time-based checkpoint due by rank 0's clock), then each rank's
    non-finite verdict, smallest/largest micro-batch item count and the rows checks :meth:`carry` in its
    own slot (zeros elsewhere: the sum is an all-gather). :class:`DeviceTotals` all-reduces it;
    :class:`HostTotals` (the CPU) exchanges each rank's numbers and builds the same layout on the host. Both
    kinds compute the same float64 numbers in the same order (for two ranks; with more, the loss sum's last bit
    may follow a different order than a ring all-reduce's), so the totals and the scale are bitwise the same
    (``tests/test_loop.py``).
    """

    HEAD = 5
    """The shared numbers before the slots: N, the loss sum, the non-finite flag, the stop and checkpoint votes."""

    def __init__(self, split: Split, rank: int, device: torch.device) -> None:
        self.split, self.rank, self.device = split, rank, device
        self.totals: torch.Tensor
        """The window's totals in the all-reduce's layout (the sum over ranks once the collective has landed)."""
        self._work: Any = None
        self._scale: torch.Tensor | None = None
        self._carried: list[Any] = []
        """The rows checks :meth:`carry`, in the form this kind sends them (:meth:`_slot_row`)."""
        self._host: list[float] | None = None

    @staticmethod
    def for_device(split: Split, rank: int, device: torch.device, exchange: RowExchange | None = None) -> WindowTotals:
        """The kind for ``device``: on the CPU the sums are Python floats (reading a CPU tensor costs no sync,
        and a dozen operations on tensors of one number cost more than the arithmetic: 0.37 ms of CPU per step on
        this project's 2-core machine, ``benchmarks.fixed_cost --sections`` in BENCHMARKS.md); on an accelerator
        the loss sum stays there (item counts that are Python numbers stay on the host until the all-reduce).
        ``exchange`` carries the CPU's rows (default: gloo's all-gather)."""
        return HostTotals(split, rank, device, exchange) if device.type == "cpu" else DeviceTotals(split, rank, device)

    @abstractmethod
    def add(self, summed: torch.Tensor, n_items: torch.Tensor | int | float, weight: float) -> torch.Tensor | float:
        """Count one micro-batch (``weight`` 0: a stand-in sample); returns its item count n."""

    @abstractmethod
    def sums(self, *extra: float) -> torch.Tensor:
        """This rank's [loss sum, item count, *extra] so far, float64 on the device."""

    def row(self, values: torch.Tensor, *extra: float) -> torch.Tensor | list[float]:
        """``values`` (float64), then this rank's loss sum and item count so far and ``extra``: a row for :meth:`carry`
        in the form this kind sends (a tensor on the device; Python floats for :class:`HostTotals`)."""
        return torch.cat([values.to(self.device, torch.float64), self.sums(*extra)])

    def _slot_row(self, row: torch.Tensor | list[float]) -> Any:
        """A carried row as :meth:`reduce` sends it: a flat float64 tensor on the device."""
        if isinstance(row, list):
            return torch.tensor(row, dtype=torch.float64, device=self.device)
        return row.reshape(-1).to(torch.float64)

    @abstractmethod
    def reduce(self, *, stop: bool, checkpoint_due: bool) -> None:
        """Launch the window's collective (asynchronous: it overlaps the last backward)."""

    @abstractmethod
    def grad_scale(self, c: float, loss_norm: str) -> torch.Tensor:
        """Wait for the collective; the factor the engine multiplies the accumulated gradient by: 1/(c N)
        (mean_per_micro: 1/c). NaN when any rank's loss was not finite, so every engine's own check of the
        (global) gradient norm skips the update on every rank alike. Computed once per window (the engine's
        reduction may ask for it first, :meth:`~distaccum.engines.base.Engine.fold_normalization`)."""

    def _launch(self, totals: torch.Tensor) -> None:
        self.totals = totals
        self._work = dist.all_reduce(totals, async_op=True)

    def carry(self, row: torch.Tensor | list[float]) -> Callable[[], list[list[float]] | None]:
        """Send this rank's float64 ``row`` with the window's collective (call before :meth:`reduce`), in this
        rank's slot with zeros in the others (summed by an all-reduce, or gathered: either is exact), so a check
        that compares numbers across ranks needs no collective of its own. The returned function gives every rank's row once
        :meth:`read` has run (None before)."""
        first, world = 3 + sum(len(r) for r in self._carried), self.split.world_size
        self._carried.append(self._slot_row(row))
        length = len(self._carried[-1])

        def rows() -> list[list[float]] | None:
            host = self._host
            if host is None:
                return None
            return [[host[self.HEAD + (first + i) * world + r] for i in range(length)] for r in range(world)]

        return rows

    def _reduced(self) -> list[float]:
        return self.totals.tolist()

    def read(self) -> WindowResult:
        """The one host read of the step's totals (on CUDA after the timer's synchronize: the device is idle)."""
        host, world, head = self._reduced(), self.split.world_size, self.HEAD
        self._host = host
        return WindowResult(items=host[0], loss_sum=host[1], bad_ranks=[r for r in range(world) if host[head + r] > 0],
                            stop_votes=host[3], checkpoint_votes=host[4],
                            items_min=min(host[head + world:head + 2 * world]),
                            items_max=max(host[head + 2 * world:head + 3 * world]))


class DeviceTotals(WindowTotals):
    """The loss sum as a float64 tensor on the device (filled in there: no host-to-device copy, so no sync), read
    by the host once, in :meth:`read`. Item counts the loss returns as Python numbers stay Python floats until the
    window's all-reduce (no device work per micro-batch for them); from the first count that is a tensor on, the
    window's count lives on the device, continuing the same sum in the same order (so it is :class:`HostTotals`'
    float64 arithmetic exactly, either way)."""

    def __init__(self, split: Split, rank: int, device: torch.device) -> None:
        super().__init__(split, rank, device)
        self.host_items = 0.0
        self.device_items: torch.Tensor | None = None
        """The window's item count on the device, once a count came as a tensor (else ``host_items``)."""
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.counts: list[torch.Tensor | float] = []
        self._landed: tuple[torch.Tensor, Any] | None = None

    def _scalar(self, x: float) -> torch.Tensor:
        return torch.full((), x, dtype=torch.float64, device=self.device)

    @property
    def items(self) -> torch.Tensor:
        """The window's item count so far, a float64 scalar on the device."""
        return self.device_items if self.device_items is not None else self._scalar(self.host_items)

    def _copy_to_host(self) -> tuple[torch.Tensor, Any]:
        """Queue the all-reduced totals' copy into pinned host memory and an event after it, on the stream that
        has just waited for them (a DDP bucket's completion while the backward runs, else the loop's after it):
        :meth:`read` waits for that event only, so reading the totals never drains the device's queue."""
        host = torch.empty(self.totals.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(self.totals, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(self.device))
        return host, landed

    def _reduced(self) -> list[float]:
        if self._landed is None:
            return self.totals.tolist()
        host, landed = self._landed
        landed.synchronize()
        return host.tolist()

    def add(self, summed: torch.Tensor, n_items: torch.Tensor | int | float, weight: float) -> torch.Tensor | float:
        if isinstance(n_items, torch.Tensor):
            n: torch.Tensor | float = item_count(n_items, self.device)
            if self.device_items is None:  # the count moves to the device, the sum so far with it
                self.device_items = self._scalar(self.host_items)
        else:
            n = float(n_items)  # exact: an integer count below 2^53, or a float
        if weight == 1.0:  # every real micro-batch: no multiplies; ``+=`` promotes the loss to float64 exactly
            self.loss_sum += summed.detach()
        else:
            n = n * weight
            self.loss_sum += summed.detach().to(torch.float64) * weight
        if self.device_items is not None:
            self.device_items += n
        else:
            self.host_items += n  # type: ignore[operator]  # a float while no count was a tensor
        self.counts.append(n)
        return n

    def sums(self, *extra: float) -> torch.Tensor:
        return torch.stack([self.loss_sum, self.items, *(self._scalar(x) for x in extra)])

    def reduce(self, *, stop: bool, checkpoint_due: bool) -> None:
        bad = (~torch.isfinite(self.loss_sum)).to(torch.float64)
        if all(isinstance(n, float) for n in self.counts):
            smallest, largest = self._scalar(min(self.counts)), self._scalar(max(self.counts))  # type: ignore[type-var]
        else:
            per_micro = torch.stack([n if isinstance(n, torch.Tensor) else self._scalar(n) for n in self.counts])
            smallest, largest = per_micro.min(), per_micro.max()
        mine = torch.cat([torch.stack([bad, smallest, largest]), *self._carried])
        slots = torch.zeros(mine.numel(), self.split.world_size, dtype=torch.float64, device=self.device)
        slots[:, self.rank] = mine
        self._launch(torch.cat([torch.stack([self.items, self.loss_sum, bad, self._scalar(float(stop)),
                                             self._scalar(float(checkpoint_due))]), slots.flatten()]))

    def grad_scale(self, c: float, loss_norm: str) -> torch.Tensor:
        if self._scale is None:
            self._work.wait()
            if self.device.type == "cuda":  # the host's copy, queued right where the totals land
                self._landed = self._copy_to_host()
            count = self.totals[0].clamp(min=1.0)
            scale = 1.0 / (c * count) if loss_norm == "global_count" else \
                torch.full((), 1.0 / c, dtype=torch.float64, device=self.device)
            self._scale = torch.where(self.totals[2] > 0, torch.full_like(scale, float("nan")), scale)
        return self._scale


class HostTotals(WindowTotals):
    """The sums as Python floats (the device is the CPU): the same float64 arithmetic as :class:`DeviceTotals`,
    in the same order, with one row made for the window's collective and one read of it. The collective is an
    exchange of this rank's numbers (``exchange``, :mod:`distaccum.cluster.exchange`: the run's Unix sockets between
    the ranks of one host, else gloo's all-gather), not an all-reduce: on gloo a ring all-reduce is a reduce-scatter
    and an all-gather, and for a few numbers the all-gather alone costs half the CPU time and context switches
    (``benchmarks.fixed_cost``: ``ddp_window_allgather`` against ``ddp_window_allreduce``)."""

    def __init__(self, split: Split, rank: int, device: torch.device, exchange: RowExchange | None = None) -> None:
        super().__init__(split, rank, device)
        self.exchange: RowExchange = exchange if exchange is not None else GlooExchange()
        self.items, self.loss_sum = 0.0, 0.0
        self.counts: list[float] = []
        self._got: list[float] | None = None
        self._work: Pending | None = None

    def add(self, summed: torch.Tensor, n_items: torch.Tensor | int | float, weight: float) -> float:
        n = float(n_items)  # exact: a float32 or float64 tensor, or an integer count below 2^53
        if weight == 1.0:
            self.loss_sum += summed.item()  # widens a float32 loss exactly, as DeviceTotals' +=
        else:
            n = n * weight
            self.loss_sum += summed.item() * weight
        self.items += n
        self.counts.append(n)
        return n

    def sums(self, *extra: float) -> torch.Tensor:
        return torch.tensor([self.loss_sum, self.items, *extra], dtype=torch.float64)

    def row(self, values: torch.Tensor, *extra: float) -> list[float]:
        """Python floats, as this kind sends them: no tensor made for them."""
        return [*values.tolist(), self.loss_sum, self.items, *extra]

    def _slot_row(self, row: torch.Tensor | list[float]) -> list[float]:
        return row if isinstance(row, list) else row.reshape(-1).to(torch.float64).tolist()

    @property
    def totals(self) -> torch.Tensor:  # type: ignore[override]
        """The all-reduce's layout, made from the gathered rows (what :class:`DeviceTotals` all-reduces)."""
        return torch.tensor(self._reduced(), dtype=torch.float64)

    def reduce(self, *, stop: bool, checkpoint_due: bool) -> None:
        """Launch the window's collective: the exchange of this rank's row (its head, its rank, its slot values)
        with every rank, which the host turns into the all-reduce's layout (:meth:`_reduced`)."""
        head, mine = self._own(stop=stop, checkpoint_due=checkpoint_due)
        self._work = self.exchange.exchange([*head, float(self.rank), *mine])

    def _own(self, *, stop: bool, checkpoint_due: bool) -> tuple[list[float], list[float]]:
        """This rank's head (its items, loss sum, non-finite flag and votes: summed over ranks) and its slot values
        (the flag, its smallest and largest micro-batch count, the carried rows: each rank's in its own slot)."""
        bad = 0.0 if math.isfinite(self.loss_sum) else 1.0
        head = [self.items, self.loss_sum, bad, float(stop), float(checkpoint_due)]
        return head, [bad, min(self.counts), max(self.counts)] + [x for row in self._carried for x in row]

    def grad_scale(self, c: float, loss_norm: str) -> torch.Tensor:
        if self._scale is None:
            got = self._reduced()
            scale = 1.0 / (c * max(got[0], 1.0)) if loss_norm == "global_count" else 1.0 / c
            self._scale = torch.full((), float("nan") if got[2] > 0 else scale, dtype=torch.float64)
        return self._scale

    def _reduced(self) -> list[float]:
        """Wait for every rank's row, once per window (the scale reads it first, :meth:`read` after), as the
        all-reduce's layout: the heads summed over ranks in rank order (the float64 sums an all-reduce of two
        ranks makes; with more, the loss sum's last bit may differ from a ring's order, the integer counts never),
        each rank's values in its slots, zeros in the others' (exactly what the sum of the slots gives)."""
        if self._got is None:
            assert self._work is not None, "reduce() launches the window's exchange first"
            head, world = self.HEAD, self.split.world_size
            rows = self._work.wait()
            sums = rows[0][:head]
            for row in rows[1:]:
                sums = [a + b for a, b in zip(sums, row[:head], strict=True)]
            slots = [0.0] * ((len(rows[0]) - head - 1) * world)
            for row in rows:
                slots[int(row[head])::world] = row[head + 1:]
            self._got = sums + slots
        return self._got
