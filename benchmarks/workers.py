"""What runs inside the launched ranks: the interleaved timing and the fresh-process memory reading.

``python -m benchmarks.workers timing|memory SPEC_JSON OUT_JSON WORKDIR`` on every rank (torchrun-style
environment; :mod:`benchmarks.run` starts it); rank 0 writes the record to OUT_JSON.

**timing**: the ranks build every variant of the spec (the same model, data and optimizer), warm each up, then run
rounds; in round r the variants run one block of ``steps`` optimizer steps each, in a balanced order
(:func:`round_order`), every rank starting each block together (a barrier, outside the timed steps). A step's time
is the slowest rank's, so the compute floor, which never synchronizes, is timed like the others. Why one process
group for everything: separate launches land on different CPU placements, cache and allocator states and machine
load, which moved a variant by +-20 % between launches on this project's machine; inside one group, drift falls on
every variant alike, so per-round ratios are tight even when absolute times move.

**memory**: the spec's one variant in processes of its own, stepped one step at a time: the step's peak memory
(process peak RSS on CPU, reset at each step's start; the CUDA allocator's peak on GPU:
:mod:`distaccum.telemetry.memory`) and distaccum's own per-step record. A process's peak RSS never goes down and
the allocator keeps freed memory mapped, so whatever ran earlier in a process would set the peak: each (variant, K)
owns its processes.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.cases import BenchData, Spec
from benchmarks.variants import EXPERT, HAND_WRITTEN, DistaccumTrainer, Variant, build_variant
from distaccum.telemetry.ledger import Clock, CudaClock, HostClock
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory

RECORD_FIELDS = (
    "time_s",
    "comm_rounds",
    "comm_calls",
    "comm_bytes",
    "gather_calls",
    "gather_bytes",
    "comm_rounds_replicate",
    "comm_calls_replicate",
    "comm_bytes_replicate",
)
"""distaccum's per-step record fields whose medians over the timed steps a memory launch keeps."""


def join(device_kind: str) -> tuple[torch.device, Clock]:
    """Join this worker's process group (torchrun-style environment) and pick its device and clock:
    ``cuda:LOCAL_RANK`` on NCCL with CUDA events (read after one synchronize per block, outside the timed steps),
    or the CPU on gloo with one intra-op thread (torchrun's default for several ranks per node) and the wall
    clock."""
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device, CudaClock(device)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    return torch.device("cpu"), HostClock()


def step_seconds(clock: Clock, stamps: list[Any]) -> list[float]:
    """Durations between consecutive stamps (call after ``clock.sync()``)."""
    return [clock.seconds(a, b) for a, b in zip(stamps[:-1], stamps[1:], strict=True)]


def round_order(order: Iterable[str], r: int) -> list[str]:
    """Round ``r``'s order: row ``r`` of a Williams design over the first order. Over len(order) rounds (twice
    that for an odd count) every variant takes every position equally often AND follows every other variant
    equally often, so neither the position in a round (drift within it) nor the variant run just before (the
    caches and allocator state it leaves) favours one variant."""
    names = list(order)
    n = len(names)
    if n < 2:
        return names
    base, low, high = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...: each difference between neighbours once
    while len(base) < n:
        if len(base) % 2:
            base.append(low)
            low += 1
        else:
            base.append(high)
            high -= 1
    row = [(b + r) % n for b in base]
    if n % 2 and (r // n) % 2:  # odd counts: the mirrored square completes the balance
        row.reverse()
    return [names[i] for i in row]


def cycle_length(n: int) -> int:
    """Rounds in one whole Williams cycle of ``n`` variants (:func:`round_order`): n, twice that for an odd count."""
    return n if n % 2 == 0 or n < 2 else 2 * n


def keep_going(started: float, budget_s: float) -> bool:
    """Rank 0's clock decides whether another cycle of rounds fits ``budget_s`` (collective: every rank gets the same
    answer; outside the timed steps)."""
    decision = [time.perf_counter() - started < budget_s] if dist.get_rank() == 0 else [None]
    dist.broadcast_object_list(decision, src=0)
    return bool(decision[0])


def largest_over_ranks(values: list[float]) -> list[float]:
    """Element by element, the largest value over ranks (collective; outside the timed steps)."""
    gathered: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, values)
    return [max(v) for v in zip(*gathered, strict=True)]  # type: ignore[misc]


def timed_block(variant: Variant, steps: int, clock: Clock) -> list[float]:
    """One block of ``steps`` optimizer steps; returns the slowest rank's time of each."""
    dist.barrier()
    stamps = variant.run(steps)
    clock.sync()
    return largest_over_ranks(step_seconds(clock, stamps))


def flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parameters as one float64 CPU vector."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])


def reference_of(names: list[str]) -> str | None:
    """The variant the others' trained parameters are compared with: the expert loop when it ran, else the first
    hand-written loop that ran, else None. Never the compute floor, which must differ."""
    if EXPERT in names:
        return EXPERT
    return next((n for n in names if n in HAND_WRITTEN and n != "compute_floor"), None)


def parameter_agreement(variants: dict[str, Variant], ref: str | None) -> dict[str, float]:
    """Largest |difference| of each variant's trained parameters from ``ref``'s, relative to the largest
    |parameter|: ~1e-7 or less when every variant did the same arithmetic on the same data. The compute floor
    averages nothing over ranks, so it must differ (a negative control). Empty without a reference."""
    if ref is None:
        return {}
    reference = flat(variants[ref].parameters())
    scale = float(reference.abs().max()) or 1.0
    out: dict[str, float] = {}
    for name, variant in variants.items():
        params = flat(variant.parameters())  # collective for sharded engines: every rank iterates
        out[name] = (
            float((params - reference).abs().max()) / scale if params.shape == reference.shape else math.inf
        )
    return out


def measure_timing(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Build, warm up and interleave every variant of ``spec``; returns rank 0's record."""
    device, clock = join(spec.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = BenchData(spec, world)
    variants = {name: build_variant(name, spec, data, rank, device, clock, workdir) for name in spec.variants}
    for variant in variants.values():  # allocation, DDP's bucket rebuild, first optimizer step, compilation
        timed_block(variant, spec.warmup, clock)
    blocks: dict[str, list[list[float]]] = {name: [] for name in variants}
    orders = []
    cycle, started = cycle_length(len(spec.variants)), time.perf_counter()
    for r in range(spec.rounds):
        if spec.budget_s > 0 and r and r % cycle == 0 and not keep_going(started, spec.budget_s):
            break  # whole cycles only: every variant in every position and after every other alike
        order = round_order(spec.variants, r)
        orders.append(order)
        for name in order:
            blocks[name].append(timed_block(variants[name], spec.steps, clock))
    reference = reference_of(list(variants))
    agreement = parameter_agreement(variants, reference)
    for variant in variants.values():
        variant.close()
    return {
        "spec": json.loads(spec.to_json()),
        "world_size": world,
        "orders": orders,
        "step_s": blocks,
        "param_rel_diff": agreement,
        "param_reference": reference,
    }


def measure_memory(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Run the spec's one variant a step at a time; returns the record (every value the largest over ranks)."""
    device, clock = join(spec.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    (name,) = spec.variants
    variant = build_variant(name, spec, BenchData(spec, world), rank, device, clock, workdir)
    setup_peak = peak_memory_bytes(device)  # nothing has reset it yet: imports, data and set-up
    peaks, times = [], []
    for step in range(spec.warmup + spec.steps):
        reset_peak_memory(
            device
        )  # distaccum's loop resets it when its step starts too; the loops get it here
        stamps = variant.run(1)
        peaks.append(peak_memory_bytes(device))
        clock.sync()
        if step >= spec.warmup:
            times.append(step_seconds(clock, stamps)[0])
    records = variant.records[spec.warmup :] if isinstance(variant, DistaccumTrainer) else []
    medians = {
        key: statistics.median(float(r[key]) for r in records)
        for key in RECORD_FIELDS
        if records and all(key in r for r in records)
    }
    variant.close()
    setup_peak, step_peak, warm_peak = largest_over_ranks([setup_peak, max(peaks[spec.warmup :]), max(peaks)])
    return {
        "spec": json.loads(spec.to_json()),
        "variant": name,
        "world_size": world,
        "step_s": largest_over_ranks(times),
        "setup_peak_bytes": setup_peak,
        "step_peak_bytes": step_peak,
        "process_peak_bytes": max(setup_peak, warm_peak),
        "records": medians,
    }


def main(argv: list[str] | None = None) -> None:
    """Worker entry: ``timing|memory SPEC_JSON OUT_JSON WORKDIR``; rank 0 writes the record to OUT_JSON."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4 or args[0] not in ("timing", "memory"):
        raise SystemExit("usage: python -m benchmarks.workers timing|memory SPEC_JSON OUT_JSON WORKDIR")
    measure = measure_timing if args[0] == "timing" else measure_memory
    record = measure(Spec.from_json(args[1]), Path(args[3]))
    if dist.get_rank() == 0:
        Path(args[2]).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo threads occasionally abort interpreter teardown; the record is on disk


if __name__ == "__main__":
    main()
