"""The step timer the training loop is handed: phase times, communication ledger, peak memory.

One optimizer step is split into phases, each a separate record field:

    data_s     collate the window's micro-batches and all-reduce its item count
    compute_s  forward + backward of every micro-batch, minus the exposed communication
    optim_s    clip, optimizer step, scheduler, consistency check
    comm_*     from the :class:`~distaccum.comm.CommLedger` (``comm_s`` overlaps compute_s;
               ``comm_exposed_s`` does not, so compute_s + comm_exposed_s = forward+backward time)

On CPU the phases are wall-clock intervals. On CUDA they are CUDA events on the current stream,
read after ``end_step``'s single ``torch.cuda.synchronize`` — the one host sync per step — and the
per-rank logging values are all-gathered over a separate gloo group on host tensors, so logging
adds no further device sync.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from distaccum.comm import Clock, CommLedger, CommStats, CudaClock, HostClock, Stamp
from distaccum.memory import peak_memory_bytes, reset_peak_memory


@dataclass
class StepTimes:
    """Timing of one optimizer step on one rank (seconds)."""

    time_s: float
    data_s: float
    compute_s: float
    optim_s: float
    comm: CommStats
    peak_mem_bytes: int

    def as_record(self) -> dict[str, float | int]:
        """The per-step record fields (flat; names as in ``metrics.jsonl``)."""
        fields = {k: v for k, v in asdict(self).items() if k != "comm"}
        return {**fields, **asdict(self.comm)}


class StepTimer:
    """Marks the phases of each optimizer step; created once per run, on every rank (collective on
    CUDA: it creates the host-side gloo group)."""

    def __init__(self, device: torch.device, ledger: CommLedger) -> None:
        self.device = device
        self.ledger = ledger
        self.clock: Clock = CudaClock(device) if device.type == "cuda" else HostClock()
        ledger.clock = self.clock  # engines' comm hooks stamp on the same clock as the phases
        self._group = dist.new_group(backend="gloo") if device.type == "cuda" else None
        self._marks: dict[str, Stamp] = {}

    def start_step(self) -> None:
        """Before anything of the step happens (resets the peak-memory window)."""
        reset_peak_memory(self.device)
        self.ledger.start_step()
        self._marks = {"start": self.clock.stamp()}

    def data_done(self) -> None:
        """The window's batches are on the device and its item count is known."""
        self._marks["data"] = self.clock.stamp()

    def start_micro(self) -> None:
        """Before each micro-batch's forward."""
        self.ledger.start_micro()

    def compute_done(self) -> None:
        """After the last micro-batch's backward (all gradient reductions have been waited for)."""
        self._marks["compute"] = self.clock.stamp()

    def end_step(self) -> StepTimes:
        """After the optimizer step. On CUDA this is the step's one host synchronization."""
        end = self.clock.stamp()
        self.clock.sync()
        comm = self.ledger.end_step(end)
        marks = self._marks

        def between(a: str, b: str) -> float:
            return self.clock.seconds(marks[a], marks[b] if b != "end" else end)

        forward_backward = between("data", "compute")
        return StepTimes(
            time_s=between("start", "end"),
            data_s=between("start", "data"),
            compute_s=max(0.0, forward_backward - comm.comm_exposed_s),
            optim_s=between("compute", "end"),
            comm=comm,
            peak_mem_bytes=peak_memory_bytes(self.device),
        )

    def gather(self, values: list[float]) -> torch.Tensor:
        """All-gather host floats from every rank: a float64 CPU tensor of shape (world, len(values))."""
        local = torch.tensor(values, dtype=torch.float64)
        gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size(self._group))]
        dist.all_gather(gathered, local, group=self._group)
        return torch.stack(gathered)
