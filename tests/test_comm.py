"""The ledger's and the step timer's arithmetic on a hand-driven clock (no processes, no sleeping)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from distaccum.telemetry.ledger import CommLedger, HostClock, union_length
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory
from distaccum.telemetry.timing import StepTimer

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


class HandClock(HostClock):
    """The host clock, whose time only moves when the test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def stamp(self) -> float:
        return self.now


def grad(numel: int) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.float32)


@pytest.fixture
def clock() -> HandClock:
    return HandClock()


@pytest.fixture
def ledger(clock: HandClock) -> CommLedger:
    led = CommLedger(clock=clock)
    led.start_step()
    return led


def at(clock: HandClock, t: float) -> None:
    clock.now = t


@pytest.mark.parametrize(
    "intervals, length",
    [
        ([], 0.0),
        ([(1.0, 2.0)], 1.0),
        ([(1.0, 3.0), (2.0, 4.0)], 3.0),
        ([(1.0, 5.0), (2.0, 3.0)], 4.0),
        ([(3.0, 4.0), (1.0, 2.0)], 2.0),
        ([(1.0, 2.0), (2.0, 3.0)], 2.0),
        ([(1.0, 1.0), (5.0, 4.0)], 0.0),
    ],
)
def test_union_length(intervals: list[tuple[float, float]], length: float) -> None:
    assert union_length(intervals) == pytest.approx(length)


def test_overlapped_buckets_only_the_tail_is_exposed(clock: HandClock, ledger: CommLedger) -> None:
    # DDP-like: bucket A is reduced while the backward still computes bucket B's gradients.
    ledger.start_micro()
    at(clock, 1.0)
    a = ledger.launched(grad(100))
    at(clock, 2.0)
    b = ledger.launched(grad(50))  # last launch: the gradient computation is over
    at(clock, 2.5)
    ledger.completed(a)
    at(clock, 3.0)
    ledger.completed(b)
    stats = ledger.end_step()
    assert (stats.comm_calls, stats.comm_bytes, stats.comm_rounds) == (2, 600, 1)
    assert stats.comm_s == pytest.approx(2.0)  # [1, 3]
    assert stats.comm_exposed_s == pytest.approx(1.0)  # [2, 3]: after the last launch


def test_earlier_bucket_finishing_last_extends_the_tail(clock: HandClock, ledger: CommLedger) -> None:
    ledger.start_micro()
    at(clock, 1.0)
    a = ledger.launched(grad(10))
    at(clock, 2.0)
    b = ledger.launched(grad(10))
    at(clock, 2.2)
    ledger.completed(b)
    at(clock, 4.0)
    ledger.completed(a)
    stats = ledger.end_step()
    assert stats.comm_s == pytest.approx(3.0)
    assert stats.comm_exposed_s == pytest.approx(2.0)  # waited from the last launch until A finished


def test_every_micro_tails_add_up_and_count_rounds(clock: HandClock, ledger: CommLedger) -> None:
    for start, end in ((1.0, 1.5), (3.0, 3.25), (5.0, 5.75)):
        ledger.start_micro()
        at(clock, start)
        token = ledger.launched(grad(8))
        at(clock, end)
        ledger.completed(token)
    ledger.start_micro()  # a micro-batch without communication is not a round
    stats = ledger.end_step()
    assert (stats.comm_calls, stats.comm_rounds, stats.comm_bytes) == (3, 3, 96)
    assert stats.comm_s == pytest.approx(1.5)
    assert stats.comm_exposed_s == pytest.approx(1.5)


def test_blocking_collectives_are_exposed_in_full(clock: HandClock, ledger: CommLedger) -> None:
    ledger.start_micro()
    for start, end in ((1.0, 2.0), (2.5, 3.0), (3.0, 4.0)):
        at(clock, start)
        with ledger.blocking(grad(4)):
            at(clock, end)
    stats = ledger.end_step()
    assert stats.comm_calls == 3 and stats.comm_rounds == 1
    assert stats.comm_s == pytest.approx(2.5)
    assert stats.comm_exposed_s == pytest.approx(2.5)  # not just the last one


def test_collective_still_in_flight_is_closed_at_step_end(clock: HandClock, ledger: CommLedger) -> None:
    ledger.start_micro()
    at(clock, 1.0)
    ledger.launched(grad(4))
    stats = ledger.end_step(end=4.0)
    assert stats.comm_s == pytest.approx(3.0) and stats.comm_exposed_s == pytest.approx(3.0)


def test_late_completion_of_previous_step_does_not_leak(clock: HandClock, ledger: CommLedger) -> None:
    ledger.start_micro()
    at(clock, 1.0)
    old = ledger.launched(grad(4))
    at(clock, 2.0)
    ledger.completed(old)
    ledger.end_step()
    at(clock, 10.0)
    ledger.start_step()
    ledger.completed(old)  # a stray callback
    stats = ledger.end_step()
    assert (stats.comm_calls, stats.comm_bytes, stats.comm_s) == (0, 0, 0.0)


def test_disabled_ledger_counts_but_does_not_time(clock: HandClock) -> None:
    ledger = CommLedger(enabled=False, clock=clock)
    ledger.start_step()
    ledger.start_micro()
    at(clock, 1.0)
    token = ledger.launched(grad(25))
    at(clock, 2.0)
    ledger.completed(token)
    stats = ledger.end_step()
    assert (stats.comm_calls, stats.comm_bytes, stats.comm_rounds) == (1, 100, 1)
    assert stats.comm_s == 0.0 and stats.comm_exposed_s == 0.0


def test_completions_from_other_threads() -> None:
    ledger = CommLedger(clock=HostClock())
    ledger.start_step()
    ledger.start_micro()
    tokens = [ledger.launched(grad(1)) for _ in range(200)]
    threads = [
        threading.Thread(target=lambda ts=tokens[i::4]: [ledger.completed(t) for t in ts]) for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = ledger.end_step()
    assert stats.comm_calls == 200 and stats.comm_bytes == 800
    assert 0.0 < stats.comm_s and stats.comm_exposed_s <= stats.comm_s + 1e-12


def test_step_timer_phases_add_up(clock: HandClock) -> None:
    ledger = CommLedger()
    timer = StepTimer(CPU, ledger)
    assert ledger.clock is timer.clock  # the hooks and the phases share one clock
    timer.clock = ledger.clock = clock
    timer.start_step()
    timer.start_micro()
    at(clock, 0.5)
    timer.batch_ready()  # the first micro-batch took 0.5 s to load
    at(clock, 1.0)
    token = ledger.launched(grad(10))
    at(clock, 2.0)
    ledger.completed(token)
    timer.start_micro()
    timer.batch_ready()
    at(clock, 3.0)
    timer.compute_done()
    at(clock, 3.25)
    times = timer.end_step()
    assert times.time_s == pytest.approx(3.25)
    assert times.data_s == pytest.approx(0.5)
    assert times.comm.comm_exposed_s == pytest.approx(1.0)
    assert times.compute_s == pytest.approx(2.5 - 1.0)  # forward+backward minus exposed comm
    assert times.optim_s == pytest.approx(0.25)
    assert times.last_micro_s == pytest.approx(
        1.0
    )  # the boundary micro-batch: from its fetch to compute_done
    assert times.peak_mem_bytes > 0
    record = times.as_record()
    assert set(record) == {
        "time_s",
        "data_s",
        "compute_s",
        "optim_s",
        "last_micro_s",
        "peak_mem_bytes",
        "comm_calls",
        "comm_bytes",
        "comm_rounds",
        "comm_s",
        "comm_exposed_s",
        "gather_calls",
        "gather_bytes",
        "comm_calls_replicate",
        "comm_bytes_replicate",
        "comm_rounds_replicate",
    }
    assert record["comm_rounds"] == 1 and record["comm_bytes"] == 40


class CountingClock(HandClock):
    """Counts the time stamps taken: the ledger's cost is what it stamps."""

    def __init__(self) -> None:
        super().__init__()
        self.stamps = 0

    def stamp(self) -> float:
        self.stamps += 1
        return super().stamp()


@pytest.mark.parametrize("enabled", [True, False])
def test_ledger_cost_is_a_bounded_number_of_stamps(enabled: bool) -> None:
    clock = CountingClock()
    ledger = CommLedger(enabled=enabled, clock=clock)
    micro, collectives = 16, 3
    ledger.start_step()
    for _ in range(micro):
        ledger.start_micro()
        for _ in range(collectives):
            ledger.completed(ledger.launched(grad(4)))
    stats = ledger.end_step(end=0.0)
    assert stats.comm_calls == micro * collectives
    # one stamp at the step's start, two per collective (launch, completion), none per micro-batch
    assert clock.stamps == (1 + 2 * micro * collectives if enabled else 0)


def test_cpu_peak_memory_is_per_window() -> None:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
    except OSError:
        if os.environ.get("CI") == "true":
            raise  # CI runs on Linux, where resetting the peak RSS must work
        pytest.skip("this kernel cannot reset the peak RSS (the peak is the lifetime peak)")
    reset_peak_memory(CPU)
    base = peak_memory_bytes(CPU)
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    grown = peak_memory_bytes(CPU)
    assert grown >= base + 48 * 2**20
    del big
    reset_peak_memory(CPU)
    assert peak_memory_bytes(CPU) < grown


class PoolClock(HandClock):
    """A clock of distinct stamp objects kept in a pool, as :class:`~distaccum.telemetry.ledger.CudaClock` keeps its
    events: records what it hands out and what comes back."""

    def __init__(self) -> None:
        super().__init__()
        self.spare: list[list[float]] = []
        self.made = 0
        self.released: list[list[float]] = []

    def stamp(self) -> list[float]:  # type: ignore[override]  # a mutable stamp: reusing one changes its time
        if self.spare:
            stamp = self.spare.pop()
        else:
            stamp, self.made = [0.0], self.made + 1
        stamp[0] = self.now
        return stamp

    def seconds(self, start: list[float], end: list[float]) -> float:  # type: ignore[override]
        return end[0] - start[0]

    def release(self, stamps: list[list[float]]) -> None:  # type: ignore[override]
        self.released += stamps
        self.spare += stamps


def test_a_resolved_step_hands_each_of_its_stamps_back_once_and_the_next_steps_reuse_them() -> None:
    """On CUDA every stamp is an event, and creating one and destroying it cost two driver calls more than recording
    it again: a step's stamps (the timer's and the ledger's; the step's start is one stamp for both) go back to the
    clock once its times are read, each exactly once (an event handed out twice would give two stamps one time), and
    later steps take them again, with times as before."""
    ledger = CommLedger()
    timer = StepTimer(CPU, ledger)
    clock = PoolClock()
    timer.clock = ledger.clock = clock
    seen = []
    for step in range(3):
        at(clock, 10.0 * step)
        timer.start_step()
        for _ in range(2):
            timer.start_micro()
            timer.batch_ready()
            token = ledger.launched(grad(4))
            at(clock, 10.0 * step + 1.0)
            ledger.completed(token)
        timer.compute_done()
        at(clock, 10.0 * step + 2.0)
        pending = timer.finish_step()
        times = pending.resolve()
        assert pending.resolve() is times  # resolved once: a second call hands nothing back again
        seen.append((times.time_s, times.comm.comm_calls, times.comm.comm_s))
        stamps = (
            1 + 2 * 2 + 1 + 1 + 2 * 2
        )  # start (shared), 2 per micro-batch, compute, end, 2 per collective
        assert len(clock.released) == stamps * (step + 1)
        assert len({id(s) for s in clock.released[-stamps:]}) == stamps  # each once
    assert clock.made == stamps  # the second and third steps made no new stamp
    assert seen == [(2.0, 2, 1.0)] * 3
