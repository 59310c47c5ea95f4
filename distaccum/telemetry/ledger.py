"""Counting and timing of gradient-reduction collectives, per optimizer step.

Engines feed the ledger from their communication hooks (DDP's ``register_comm_hook``) or from a
tap on the torch.distributed collectives they call (FSDP2, DeepSpeed):

- asynchronous collectives: ``token = ledger.launched(tensor)`` when the collective is issued and
  ``ledger.completed(token)`` from its completion callback (``future.then``);
- blocking collectives (the caller waits for the result): ``with ledger.blocking(tensor): ...``.

The loop (through :class:`distaccum.telemetry.timing.StepTimer`) calls ``start_step``, ``start_micro`` before
each micro-batch and ``close_step`` (``end_step``: close and resolve at once). What comes out, per step and rank (:class:`CommStats`):

- ``comm_calls`` / ``comm_bytes``: gradient collectives launched and the bytes of their input
  tensors (one copy of what was reduced, in the dtype it was reduced in, whatever the algorithm
  sends on the wire). Flat engines (DDP, Accelerate, DeepSpeed, FSDP2 over one mesh dimension):
  every gradient collective. FSDP2 hybrid sharding (HSDP): the *in-replica* ones only (the
  reduce-scatters inside each replica's shard group).
- ``comm_rounds``: micro-batches in which at least one of those collectives was launched.
- ``comm_calls_replicate`` / ``comm_bytes_replicate`` / ``comm_rounds_replicate``: the same for the
  *cross-replica* collectives of HSDP (the all-reduce of each unit's reduce-scattered shard across
  replicas; its input is the shard, 1/shards of the unit). 0 on flat engines. FSDP2 issues one
  all-reduce per FSDP unit, so ``comm_rounds_replicate`` (1 per step with ``accum.sync=boundary`` or
  ``replica_boundary``, K with ``every_micro``) is the per-step count of cross-replica reductions and
  ``comm_calls_replicate`` is that times the number of units.
- ``gather_calls`` / ``gather_bytes``: parameter all-gathers and the bytes of the full tensors they
  produce, for engines whose tap counts them (``comm_tap``; FSDP2 today, 0 elsewhere). Counted only,
  never timed: they are not gradient reductions and take no part in ``comm_s``.
- ``comm_s``: length of the union of the intervals during which a gradient collective (of either
  group) was in flight
  (launch to completion), overlapped with compute or not.
- ``comm_exposed_s``: length of the union of the intervals during which communication was in flight
  and no gradient computation was left to hide it: every blocking collective in full, plus, for each
  micro-batch, the tail from its *last* asynchronous launch to the completion of its last
  collective. The last launch marks the end of the gradient computation — DDP launches a bucket as
  soon as its last gradient is produced, and the bucket holding the first layers is produced last —
  so anything still in flight after it is time the backward call spends waiting for the network.

Timestamps come from a :class:`Clock`: ``perf_counter`` on CPU; CUDA events on GPU, resolved once they have
completed (``StepTimer``: after the step's synchronize, or a step later without one), so the ledger itself never
syncs. ``close_step`` takes the step's snapshot when it ends; what it returns resolves the figures when asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch

Stamp = Any
"""A point in time: a ``perf_counter`` float (host clock) or a recorded ``torch.cuda.Event``."""


class Clock(Protocol):
    """Where timestamps come from; ``seconds`` is only valid after ``sync``, or ``wait`` for its end."""

    def stamp(self) -> Stamp: ...

    def seconds(self, start: Stamp, end: Stamp) -> float: ...

    def sync(self) -> None: ...

    def wait(self, stamp: Stamp) -> None:
        """Until the work before ``stamp`` has completed (only that work: other streams' later work goes on)."""
        ...

    def release(self, stamps: list[Stamp]) -> None:
        """Hand back stamps whose times have been read, once each: a later :meth:`stamp` may reuse them."""
        ...


class HostClock:
    """Wall clock of this process (CPU runs: the work happens on the host, so wall time is the time)."""

    def stamp(self) -> float:
        return time.perf_counter()

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def sync(self) -> None:
        pass

    def wait(self, stamp: float) -> None:
        pass

    def release(self, stamps: list[float]) -> None:
        pass


class CudaClock:
    """CUDA events recorded on the calling thread's current stream; resolved after one sync per step.

    Host timestamps would measure when kernels were *queued*, not when they ran. Events whose times have been read
    are recorded again (:meth:`release`): creating and destroying one per stamp costs two more driver calls each, and
    a step takes a few per micro-batch and per gradient bucket.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._spare: list[torch.cuda.Event] = []

    def stamp(self) -> torch.cuda.Event:
        try:
            event = self._spare.pop()  # atomic: comm hooks stamp from other threads
        except IndexError:
            event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def release(self, stamps: list[torch.cuda.Event]) -> None:
        self._spare.extend(stamps)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000.0

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)  # host sync: every event of the step has completed after it

    def wait(self, stamp: torch.cuda.Event) -> None:
        stamp.synchronize()  # returns at once for an event the device has passed


@dataclass
class CommStats:
    """Gradient-reduction counters of one optimizer step on one rank."""

    comm_calls: int = 0
    comm_bytes: int = 0
    comm_rounds: int = 0
    comm_s: float = 0.0
    comm_exposed_s: float = 0.0
    gather_calls: int = 0
    gather_bytes: int = 0
    comm_calls_replicate: int = 0
    comm_bytes_replicate: int = 0
    comm_rounds_replicate: int = 0


@dataclass(eq=False)
class _Collective:
    micro: int
    nbytes: int
    blocking: bool
    replicate: bool = False
    start: Stamp = None
    end: Stamp = None


class CommLedger:
    """Per-step record of gradient collectives. Thread-safe: completion callbacks run on the process
    group's worker threads. With ``enabled=False`` it still counts calls and bytes but takes no time
    stamps."""

    def __init__(self, enabled: bool = True, clock: Clock | None = None) -> None:
        self.enabled = enabled
        self.clock: Clock = clock or HostClock()
        self._lock = threading.Lock()
        self._collectives: list[_Collective] = []
        self._micro = 0
        self._step_start: Stamp = None
        self._gathers = [0, 0]  # calls, bytes
        self._pending: list[torch.futures.Future[Any]] = []

    def start_step(self, start: Stamp = None) -> None:
        """Forget the previous step; time is measured from here: ``start``, the caller's stamp (the step timer's
        own start: one stamp for both), else one of the ledger's."""
        if self.enabled and start is None:
            start = self.clock.stamp()
        with self._lock:
            self._collectives = []
            self._micro = 0
            self._gathers = [0, 0]
            self._step_start = start

    def start_micro(self) -> None:
        """Mark the start of the next micro-batch (rounds and exposed tails are per micro-batch)."""
        with self._lock:
            self._micro += 1

    def launched(self, tensor: torch.Tensor, *, blocking: bool = False, replicate: bool = False) -> object:
        """Record a gradient collective on ``tensor`` being issued (``replicate``: across HSDP replicas);
        returns the token for ``completed``."""
        record = _Collective(self._micro, tensor.numel() * tensor.element_size(), blocking, replicate)
        if self.enabled:
            record.start = self.clock.stamp()
        with self._lock:
            self._collectives.append(record)
        return record

    def completed(self, token: object) -> None:
        """Record the collective behind ``token`` (from ``launched``) having finished."""
        assert isinstance(token, _Collective)
        if self.enabled:
            token.end = self.clock.stamp()

    def completes_with(self, token: object, future: torch.futures.Future[Any]) -> None:
        """Record the collective behind ``token`` as finished when ``future`` (its work's) completes. The callback
        runs on the process group's worker thread; its own future is kept until :meth:`drain`, so that no
        callback into Python is still pending when the process leaves (one run at interpreter exit aborts it)."""
        chained = future.then(lambda _: self.completed(token))
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]  # done() is a flag: no wait
            self._pending.append(chained)

    def drain(self) -> None:
        """Wait for every completion callback still pending (:meth:`completes_with`): before the engine and the
        process group go away."""
        with self._lock:
            pending, self._pending = self._pending, []
        for future in pending:
            future.wait()

    def gathered(self, nbytes: int) -> None:
        """Count one parameter all-gather producing ``nbytes`` (no time stamps: a count only)."""
        with self._lock:
            self._gathers[0] += 1
            self._gathers[1] += nbytes

    @contextmanager
    def blocking(self, tensor: torch.Tensor, *, replicate: bool = False) -> Iterator[None]:
        """Wrap a collective the caller waits for: all of its time counts as exposed."""
        token = self.launched(tensor, blocking=True, replicate=replicate)
        try:
            yield
        finally:
            self.completed(token)

    def micro_batches(self) -> int:
        """Micro-batches of the step so far (``start_micro`` calls): the step's K once its window ran."""
        with self._lock:
            return self._micro

    def rounds(self) -> tuple[int, int]:
        """Micro-batches of the step so far in which a gradient collective was launched: (in-replica,
        cross-replica). A count only (no time stamps, no waiting): what
        :class:`~distaccum.guards.reduction_count.ReductionCount` compares with the engine's promise right after
        the optimizer step."""
        with self._lock:
            inner = {c.micro for c in self._collectives if not c.replicate}
            across = {c.micro for c in self._collectives if c.replicate}
        return len(inner), len(across)

    def end_step(self, end: Stamp = None) -> CommStats:
        """Counters of the step that just ended. On CUDA call it after the clock's sync.

        ``end`` (default: now) closes collectives still in flight; the engines here wait for their
        reductions before the optimizer step, so there are normally none.
        """
        return self.close_step(end)()

    def close_step(self, end: Stamp = None) -> Callable[[], CommStats]:
        """Snapshot the step that just ended (the next ``start_step`` may come before its events complete);
        the returned function computes its :class:`CommStats`, waiting for each of its CUDA events first."""
        with self._lock:
            collectives = list(self._collectives)
            gather_calls, gather_bytes = self._gathers
            start = self._step_start
        if self.enabled and collectives and end is None and any(c.end is None for c in collectives):
            end = self.clock.stamp()
        return partial(self._stats_once, collectives, gather_calls, gather_bytes, start, end)

    def _stats_once(
        self, collectives: list[_Collective], gather_calls: int, gather_bytes: int, start: Stamp, end: Stamp
    ) -> CommStats:
        """:meth:`_stats`, then the collectives' stamps go back to the clock (called once per step). The step's
        start and end are the caller's to hand back (the step timer's); one the ledger took itself, without a
        timer, is simply dropped."""
        stats = self._stats(collectives, gather_calls, gather_bytes, start, end)
        if self.enabled:
            self.clock.release([s for c in collectives for s in (c.start, c.end) if s is not None])
        return stats

    def _stats(
        self, collectives: list[_Collective], gather_calls: int, gather_bytes: int, start: Stamp, end: Stamp
    ) -> CommStats:
        inner = [c for c in collectives if not c.replicate]
        across = [c for c in collectives if c.replicate]
        stats = CommStats(
            comm_calls=len(inner),
            comm_bytes=sum(c.nbytes for c in inner),
            comm_rounds=len({c.micro for c in inner}),
            gather_calls=gather_calls,
            gather_bytes=gather_bytes,
            comm_calls_replicate=len(across),
            comm_bytes_replicate=sum(c.nbytes for c in across),
            comm_rounds_replicate=len({c.micro for c in across}),
        )
        if not self.enabled or not collectives:
            return stats

        def at(stamp: Stamp) -> float:
            self.clock.wait(stamp)  # a completion stamp may sit on another stream than the step's end
            return self.clock.seconds(start, stamp)

        spans = [(at(c.start), at(c.end if c.end is not None else end), c) for c in collectives]
        stats.comm_s = union_length([(s, e) for s, e, _ in spans])
        exposed = [(s, e) for s, e, c in spans if c.blocking]
        for micro in {c.micro for c in collectives}:
            tail = [(s, e) for s, e, c in spans if c.micro == micro and not c.blocking]
            if tail:
                exposed.append((max(s for s, _ in tail), max(e for _, e in tail)))
        stats.comm_exposed_s = union_length(exposed)
        return stats


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by possibly overlapping ``(start, end)`` intervals (empty ones ignored)."""
    total = 0.0
    current: tuple[float, float] | None = None
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if current is None or start > current[1]:
            if current is not None:
                total += current[1] - current[0]
            current = (start, end)
        else:
            current = (current[0], max(current[1], end))
    if current is not None:
        total += current[1] - current[0]
    return total
