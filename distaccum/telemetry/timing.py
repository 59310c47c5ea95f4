"""The step timer the training loop is handed: phase times, communication ledger, peak memory.

One optimizer step is split into phases, each a separate record field:

    data_s     fetch each micro-batch from the DataLoader and move it to the device, just before
               its forward (only one micro-batch's inputs are alive at a time)
    compute_s  forward + backward of every micro-batch, minus the exposed communication
    optim_s    the window's item-count all-reduce, normalize + clip, optimizer step, scheduler,
               consistency check
    last_micro_s  the window's last (boundary) micro-batch alone: fetch + forward + backward + the
               reduction it waits for. The other K-1 take (time_s - optim_s - last_micro_s) / (K-1) each:
               what one more micro-batch costs (``distaccum plan`` extrapolates K with it)
    comm_*     from the :class:`~distaccum.telemetry.ledger.CommLedger` (``comm_s`` overlaps compute_s;
               ``comm_exposed_s`` does not, so compute_s + comm_exposed_s = forward+backward time)

The loop does not call the timer inside its step: :meth:`StepTimer.watch` wraps the window source, so each
micro-batch's fetch is stamped as the step asks for it, and the step asking for one micro-batch more than the
window holds marks the end of the K forward/backward passes (``compute``). The loop itself only starts and
finishes each step.

On CPU the phases are wall-clock intervals. On CUDA they are CUDA events on the current stream.
``finish_step`` closes the step and returns its :class:`PendingTimes`; ``resolve`` waits for the step's own
events only (``Event.synchronize``), so the loop can resolve step n once step n+1 is queued and the device
never drains for the timer (:mod:`distaccum.loop`'s lagged records). ``end_step`` is the synchronous form:
one ``torch.cuda.synchronize``, then the figures. The per-rank logging values are all-gathered over a
separate gloo group on host tensors, so logging adds no device sync.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from distaccum.data.pipeline import WindowBatches, WindowSource
from distaccum.runtime.procgroup import gather_rows
from distaccum.telemetry.ledger import Clock, CommLedger, CommStats, CudaClock, HostClock, Stamp
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory
from distaccum.window import WindowResult


@dataclass
class StepTimes:
    """Timing of one optimizer step on one rank (seconds)."""

    time_s: float
    data_s: float
    compute_s: float
    optim_s: float
    last_micro_s: float
    comm: CommStats
    peak_mem_bytes: int

    def as_record(self) -> dict[str, float | int]:
        """The per-step record fields (flat; names as in ``metrics.jsonl``)."""
        fields = {k: v for k, v in vars(self).items() if k != "comm"}  # flat fields: no deep copy (asdict)
        return {**fields, **vars(self.comm)}


@dataclass
class PendingTimes:
    """A closed step whose figures are computed when asked (:meth:`resolve`, once): on CUDA once its events have
    completed, which ``resolve`` waits for (the step's end event, then each collective's), and no more; its stamps
    then go back to the clock."""

    clock: Clock
    marks: dict[str, Stamp]
    micro_data: list[tuple[Stamp, Stamp]]
    end: Stamp
    comm: Callable[[], CommStats]
    peak_mem_bytes: int
    _resolved: StepTimes | None = field(default=None, init=False, repr=False)

    def resolve(self) -> StepTimes:
        if self._resolved is None:
            self._resolved = self._resolve()
        return self._resolved

    def _resolve(self) -> StepTimes:
        clock, marks, end = self.clock, self.marks, self.end
        clock.wait(end)
        comm = self.comm()

        def between(a: str, b: str) -> float:
            return clock.seconds(marks[a], marks[b] if b != "end" else end)

        micro_data = sum(clock.seconds(a, b) for a, b in self.micro_data)
        forward_backward = between("start", "compute") - micro_data
        times = StepTimes(
            time_s=between("start", "end"),
            data_s=micro_data,
            compute_s=max(0.0, forward_backward - comm.comm_exposed_s),
            optim_s=between("compute", "end"),
            last_micro_s=clock.seconds(self.micro_data[-1][0], marks["compute"]) if self.micro_data else 0.0,
            comm=comm,
            peak_mem_bytes=self.peak_mem_bytes,
        )
        clock.release(
            [*marks.values(), *(s for pair in self.micro_data for s in pair), end]
        )  # read: reusable
        return times


class StepTimer:
    """Marks the phases of each optimizer step; created once per run, on every rank (collective on
    CUDA: it creates the host-side gloo group)."""

    def __init__(self, device: torch.device, ledger: CommLedger, group: Any = None) -> None:
        """``group``: the ranks whose timings are gathered (None: the world; an outer-synced run's island, which
        on CUDA must be a gloo group)."""
        self.device = device
        self.ledger = ledger
        self.clock: Clock = CudaClock(device) if device.type == "cuda" else HostClock()
        ledger.clock = self.clock  # engines' comm hooks stamp on the same clock as the phases
        self._group = group if group is not None or device.type != "cuda" else dist.new_group(backend="gloo")
        self._marks: dict[str, Stamp] = {}
        self._micro_start: Stamp | None = None
        self._micro_data: list[tuple[Stamp, Stamp]] = []

    def start_step(self) -> None:
        """Before anything of the step happens (resets the peak memory: the step's peak is measured from here)."""
        reset_peak_memory(self.device)
        start = self.clock.stamp()
        self.ledger.start_step(start)
        self._marks = {"start": start}
        self._micro_data = []

    def start_micro(self) -> None:
        """Before each micro-batch is collated."""
        self.ledger.start_micro()
        self._micro_start = self.clock.stamp()

    def batch_ready(self) -> None:
        """The micro-batch is collated and on the device; its forward starts next."""
        assert self._micro_start is not None
        self._micro_data.append((self._micro_start, self.clock.stamp()))

    def compute_done(self, stamp: Stamp | None = None) -> None:
        """After the last micro-batch's backward (all gradient reductions have been waited for)."""
        self._marks["compute"] = self.clock.stamp() if stamp is None else stamp

    def watch(self, source: WindowSource) -> WindowSource:
        """``source`` with every micro-batch it serves timed (:class:`TimedSource`)."""
        return cast(WindowSource, TimedSource(source, self))

    def _timed(self, micro: Iterator[Any]) -> Iterator[Any]:
        while True:
            start = self.clock.stamp()
            try:
                batch = next(micro)
            except StopIteration:  # the step asked for one micro-batch more: its K passes are done
                self.compute_done(start)
                return
            self._micro_data.append((start, self.clock.stamp()))
            self.ledger.start_micro()
            yield batch

    def end_step(self) -> StepTimes:
        """After the optimizer step: the step's figures at once (on CUDA one host synchronization)."""
        return self.finish_step(sync=True).resolve()

    def finish_step(self, *, sync: bool = False) -> PendingTimes:
        """After the optimizer step: close the step (its end stamp, the ledger's snapshot, the allocator's peak,
        which the host keeps and reading it waits for nothing); ``sync`` synchronizes the device first."""
        end = self.clock.stamp()
        if sync:
            self.clock.sync()
        return PendingTimes(
            self.clock,
            self._marks,
            self._micro_data,
            end,  # start_step makes new ones
            self.ledger.close_step(end),
            peak_memory_bytes(self.device),
        )

    def gather(self, values: list[float]) -> torch.Tensor:
        """All-gather host floats from every rank: a float64 CPU tensor of shape (world, len(values))."""
        return gather_rows(values, group=self._group, device=torch.device("cpu"))


class TimedSource:
    """A window source whose windows' micro-batches are timed by a :class:`StepTimer` as they are fetched (the
    ``data_s``, ``compute_s`` and ``last_micro_s`` phases). Everything else (its position, ``advance``, its state)
    is the source's own, read through this wrapper."""

    def __init__(self, source: WindowSource, timer: StepTimer) -> None:
        self.source, self.timer = source, timer

    def window(self) -> WindowBatches:
        window = self.source.window()
        window.micro = self.timer._timed(window.micro)
        return window

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


class RankStats:
    """The straggler view (a :class:`~distaccum.loop.StepMonitor`): every ``every`` optimizer steps, every
    rank's compute time (``compute_min_s`` / ``compute_max_s``): one all-gather of host floats, every N
    steps only, since on a slow interconnect it costs as much as a tiny step."""

    def __init__(self, timer: StepTimer, every: int) -> None:
        self.timer, self.every = timer, every

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None:
        pass

    def fields(
        self, record: dict[str, object], times: StepTimes, records: list[dict[str, object]]
    ) -> dict[str, object]:
        if not self.every or int(record["step"]) % self.every:  # type: ignore[call-overload]
            return {}
        compute = self.timer.gather([times.compute_s])[:, 0]
        return {"compute_min_s": float(compute.min()), "compute_max_s": float(compute.max())}
