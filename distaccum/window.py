"""The window's totals: its running sums on each rank (loss, item count, flags) and its ONE collective.

Where the loop's N, the global item count of an optimizer step's window, comes from (:mod:`distaccum.loop` has
the math): every rank adds each micro-batch's summed loss and item count, and after the last forward one
collective gives the sums over all ranks, with the flags every rank must agree on and the rows a check carries
(:meth:`WindowTotals.carry`). :class:`DeviceTotals` keeps the sums on an accelerator and all-gathers the rows there;
:class:`HostTotals`, the CPU's, keeps Python floats and exchanges each rank's numbers
(:mod:`distaccum.cluster.exchange`: Unix sockets between the ranks of one host, gloo's all-gather otherwise). Both send
one row per rank (:data:`ROW`) and build the totals from every rank's row on the host alike (:func:`layout`).
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

ROW = ("loss_sum", "items", "stop", "checkpoint", "rank", "items_min", "items_max")
"""What each rank sends for the window, in this order, then the rows checks carry (:meth:`WindowTotals.carry`)."""
_SENT = len(ROW)

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the name before torch 2.13


def layout(rows: list[list[float]], world: int) -> list[float]:
    """The window's totals from every rank's row (:data:`ROW`; in rank order): N, the loss sum, the number of ranks
    whose loss was not finite, the stop and checkpoint votes, each summed over the ranks in rank order on the host
    (float64; an item count is an integer below 2^53 or the loss's own float, so N is exact, and the loss sum is the
    same number on every rank), then each rank's own values in its slots (value-major: slot ``j * world + r``):
    its non-finite flag, its smallest and largest micro-batch count and its carried rows, zeros in the slots of
    ranks that sent no row (the layout an all-reduce of per-rank slots would give)."""
    first = rows[0]
    items, loss, stop, checkpoint = first[1], first[0], first[2], first[3]
    bad = [0.0 if math.isfinite(row[0]) else 1.0 for row in rows]
    flagged = bad[0]
    for row, flag in zip(rows[1:], bad[1:], strict=True):
        items, loss, flagged = items + row[1], loss + row[0], flagged + flag
        stop, checkpoint = stop + row[2], checkpoint + row[3]
    slots = [0.0] * ((len(first) - _SENT + 3) * world)
    for row, flag in zip(rows, bad, strict=True):
        slots[int(row[4])::world] = [flag, *row[5:]]
    return [items, loss, flagged, stop, checkpoint, *slots]


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
    """The window's totals over every rank, read on the host once per step (identical on every rank)."""

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

    Each rank sends one row (:data:`ROW`: its loss sum, item count, stop and checkpoint votes, rank, smallest and
    largest micro-batch count, then the rows checks :meth:`carry`); every rank gets every row, and the host turns
    them into the totals (:func:`layout`: N, the loss sum, how many ranks' losses were not finite, the votes, then
    each rank's values in its own slot). :class:`DeviceTotals` all-gathers the rows on the device;
    :class:`HostTotals` (the CPU) exchanges them as Python floats. Both kinds compute the same float64 numbers in
    the same order, so the totals and the scale are bitwise the same (``tests/test_loop.py``).
    """

    HEAD = 5
    """The shared numbers before the slots: N, the loss sum, the non-finite flag, the stop and checkpoint votes."""

    def __init__(self, split: Split, rank: int, device: torch.device) -> None:
        self.split, self.rank, self.device = split, rank, device
        self._work: Any = None
        self._got: list[float] | None = None
        self._scale: torch.Tensor | None = None
        self._carried: list[Any] = []
        """The rows checks :meth:`carry`, in the form this kind sends them (:meth:`_slot_row`)."""
        self._host: list[float] | None = None

    @staticmethod
    def for_device(split: Split, rank: int, device: torch.device, exchange: RowExchange | None = None) -> WindowTotals:
        """The kind for ``device``: on the CPU the sums are Python floats (reading a CPU tensor costs no sync,
        and a dozen operations on tensors of one number cost more than the arithmetic: 0.37 ms of CPU per step on
        this project's 2-core machine, ``benchmarks.fixed_cost --sections`` in BENCHMARKS.md); on an accelerator
        the loss sum stays there (item counts that are Python numbers stay on the host until the collective).
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

    @property
    def totals(self) -> torch.Tensor:
        """The window's totals (:func:`layout`), once every rank's row has come (waits for them)."""
        return torch.tensor(self._reduced(), dtype=torch.float64)

    def carry(self, row: torch.Tensor | list[float]) -> Callable[[], list[list[float]] | None]:
        """Send this rank's float64 ``row`` with the window's collective (call before :meth:`reduce`), in this
        rank's slot with zeros in the others (gathered: exact), so a check
        that compares numbers across ranks needs no collective of its own. The returned function gives every rank's row once
        :meth:`read` has run (None before)."""
        first, world = 3 + sum(len(r) for r in self._carried), self.split.world_size  # after the flag, min, max
        self._carried.append(self._slot_row(row))
        length = len(self._carried[-1])

        def rows() -> list[list[float]] | None:
            host = self._host
            if host is None:
                return None
            return [[host[self.HEAD + (first + i) * world + r] for i in range(length)] for r in range(world)]

        return rows

    @abstractmethod
    def _rows(self) -> list[list[float]]:
        """Wait for every rank's row (:data:`ROW`, then the carried rows), in rank order."""

    def _reduced(self) -> list[float]:
        """The totals (:func:`layout`), from every rank's row, waited for once per window (the scale reads them
        first, :meth:`read` after)."""
        if self._got is None:
            self._got = layout(self._rows(), self.split.world_size)
        return self._got

    def read(self) -> WindowResult:
        """The one host read of the step's totals (on CUDA after the timer's synchronize: the device is idle)."""
        host, world, head = self._reduced(), self.split.world_size, self.HEAD
        self._host = host
        return WindowResult(items=host[0], loss_sum=host[1], bad_ranks=[r for r in range(world) if host[head + r] > 0],
                            stop_votes=host[3], checkpoint_votes=host[4],
                            items_min=min(host[head + world:head + 2 * world]),
                            items_max=max(host[head + 2 * world:head + 3 * world]))


class DeviceTotals(WindowTotals):
    """The loss sum as a tensor on the device, read by the host once, in :meth:`read`. Item counts the loss returns as
    Python numbers stay Python floats until the window's collective (no device work per micro-batch for them); from
    the first count that is a tensor on, the window's count lives on the device, continuing the same sum in the same
    order (so it is :class:`HostTotals`' float64 arithmetic exactly, either way).

    On an accelerator every operation is a launch the host pays for (tens of microseconds each where the driver's
    calls are slow), so the window makes few: the first micro-batch's loss is kept as it came (widened to float64
    exactly where it is sent), each later one is one addition; the row is one copy of the host's numbers from pinned
    memory and one concatenation; one all-gather (none in a world of one: the row is all there is); the scale five
    operations, into memory allocated on the loop's stream (DDP asks for it in a comm hook's continuation, which runs
    on a stream from the pool: allocating there cached a new 2 MiB block per pool stream, a ``cudaMalloc`` per step
    for the first 32 steps)."""

    def __init__(self, split: Split, rank: int, device: torch.device) -> None:
        super().__init__(split, rank, device)
        self.host_items = 0.0
        self.device_items: torch.Tensor | None = None
        """The window's item count on the device, once a count came as a tensor (else ``host_items``)."""
        self.loss_sum: torch.Tensor | None = None
        """The window's loss sum: the first micro-batch's loss as it came (0 + x is x), float64 from the second on."""
        self.counts: list[torch.Tensor | float] = []
        self._gathered: torch.Tensor | None = None
        """Every rank's row, one after another (the process group's ranks, in rank order)."""
        self._scratch: torch.Tensor | None = None
        self._waited = False
        self._landed: tuple[torch.Tensor, Any] | None = None

    def _scalar(self, x: float) -> torch.Tensor:
        return torch.full((), x, dtype=torch.float64, device=self.device)

    @property
    def items(self) -> torch.Tensor:
        """The window's item count so far, a float64 scalar on the device."""
        return self.device_items if self.device_items is not None else self._scalar(self.host_items)

    def _loss64(self) -> torch.Tensor:
        """The loss sum so far as a float64 tensor."""
        return self._scalar(0.0) if self.loss_sum is None else self.loss_sum.to(torch.float64)

    def add(self, summed: torch.Tensor, n_items: torch.Tensor | int | float, weight: float) -> torch.Tensor | float:
        if isinstance(n_items, torch.Tensor):
            n: torch.Tensor | float = item_count(n_items, self.device)
            if self.device_items is None:  # the count moves to the device, the sum so far with it
                self.device_items = self._scalar(self.host_items)
        else:
            n = float(n_items)  # exact: an integer count below 2^53, or a float
        loss = summed.detach()
        if weight != 1.0:  # a stand-in sample (weight 0): adds nothing, but a non-finite loss still shows (NaN)
            n = n * weight
            loss = loss.to(torch.float64) * weight
        # Never in place: the first loss is the caller's tensor. Widening a float32 or bf16 loss is exact.
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum.to(torch.float64) + loss
        if self.device_items is not None:
            self.device_items = self.device_items + n
        else:
            self.host_items += n  # type: ignore[operator]  # a float while no count was a tensor
        self.counts.append(n)
        return n

    def sums(self, *extra: float) -> torch.Tensor:
        return torch.stack([self._loss64(), self.items, *(self._scalar(x) for x in extra)])

    def reduce(self, *, stop: bool, checkpoint_due: bool) -> None:
        votes = [float(stop), float(checkpoint_due), float(self.rank)]
        if self.device_items is None:  # every count a Python number: one copy of the host's numbers
            pieces = [self._from_host([self.host_items, *votes, min(self.counts), max(self.counts)])]  # type: ignore[type-var]
        else:
            per_micro = torch.stack([n if isinstance(n, torch.Tensor) else self._scalar(n) for n in self.counts])
            smallest, largest = torch.aminmax(per_micro)
            pieces = [self.device_items.reshape(1), self._from_host(votes), smallest.reshape(1), largest.reshape(1)]
        row = torch.cat([self._loss64().reshape(1) if self.loss_sum is None else self.loss_sum.reshape(1),
                         *pieces, *self._carried]).to(torch.float64)  # cat widens a float32 loss (exactly)
        self._scratch = torch.empty(4, dtype=torch.float64, device=self.device)  # the scale's, on this stream
        world = dist.get_world_size()
        if world == 1:  # no peer: this rank's row is every row (as the CPU's exchange sends nothing at one rank)
            self._gathered, self._work = row, None
            return
        self._gathered = torch.empty(world * row.numel(), dtype=torch.float64, device=self.device)
        self._work = _all_gather(self._gathered, row, async_op=True)

    def _from_host(self, values: list[float]) -> torch.Tensor:
        """Python numbers as a float64 tensor on the device: copied from pinned memory, without waiting (filling
        each in on the device would be a launch per number)."""
        pinned = self.device.type == "cuda"
        return torch.tensor(values, dtype=torch.float64, pin_memory=pinned).to(self.device, non_blocking=pinned)

    def _wait(self) -> torch.Tensor:
        assert self._gathered is not None, "reduce() launches the window's collective first"
        if not self._waited:  # on CUDA: this stream waits for the collective, the host does not
            if self._work is not None:
                self._work.wait()
            self._waited = True
        return self._gathered

    def _copy_to_host(self, gathered: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Queue the gathered rows' copy into pinned host memory and an event after it, on the stream that has just
        waited for them (a DDP bucket's continuation while the backward runs, else the loop's after it): :meth:`read`
        waits for that event only, so reading the totals never drains the device's queue."""
        host = torch.empty(gathered.shape, dtype=torch.float64, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(self.device))
        return host, landed

    def _rows(self) -> list[list[float]]:
        gathered = self._wait()
        if self._landed is not None:
            gathered, landed = self._landed
            landed.synchronize()
        return gathered.view(dist.get_world_size(), -1).tolist()

    def grad_scale(self, c: float, loss_norm: str) -> torch.Tensor:
        if self._scale is None:
            gathered, scratch = self._wait(), self._scratch
            assert scratch is not None
            if self.device.type == "cuda":  # the host's copy, queued right where the rows land
                self._landed = self._copy_to_host(gathered)
            rows = gathered.view(dist.get_world_size(), -1)
            if rows.shape[0] == 1:
                loss, count = rows[0, 0], rows[0, 1]
            else:  # N exactly (integer counts); the loss sum only for its finiteness
                torch.sum(rows[:, :2], dim=0, out=scratch[:2])
                loss, count = scratch[0], scratch[1]
            scale = scratch[2]
            if loss_norm == "global_count":  # 1/(c N): c N is exact (c a power of two), then one rounding
                torch.clamp(count, min=1.0, out=scale)
                scale.mul_(c).reciprocal_()
            else:
                scale.fill_(1.0 / c)
            torch.mul(loss, 0.0, out=scratch[3])  # +-0, or NaN when some rank's loss was not finite
            self._scale = scale.add_(scratch[3])  # exact: x + 0 is x
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
        self._work: Pending | None = None

    def add(self, summed: torch.Tensor, n_items: torch.Tensor | int | float, weight: float) -> float:
        n = float(n_items)  # exact: a float32 or float64 tensor, or an integer count below 2^53
        if weight == 1.0:
            self.loss_sum += summed.item()  # widens a float32 loss exactly, as DeviceTotals does
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

    def reduce(self, *, stop: bool, checkpoint_due: bool) -> None:
        """Launch the window's collective: the exchange of this rank's row (:data:`ROW`) with every rank."""
        self._work = self.exchange.exchange(self.own_row(stop=stop, checkpoint_due=checkpoint_due))

    def own_row(self, *, stop: bool, checkpoint_due: bool) -> list[float]:
        """What this rank sends (:data:`ROW`, then the carried rows)."""
        return [self.loss_sum, self.items, float(stop), float(checkpoint_due), float(self.rank), min(self.counts),
                max(self.counts), *(x for row in self._carried for x in row)]

    def grad_scale(self, c: float, loss_norm: str) -> torch.Tensor:
        if self._scale is None:
            got = self._reduced()
            scale = 1.0 / (c * max(got[0], 1.0)) if loss_norm == "global_count" else 1.0 / c
            self._scale = torch.full((), float("nan") if got[2] > 0 else scale, dtype=torch.float64)
        return self._scale

    def _rows(self) -> list[list[float]]:
        assert self._work is not None, "reduce() launches the window's exchange first"
        return self._work.wait()
