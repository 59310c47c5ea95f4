"""The timing worker: every variant lives in the same two processes and runs in alternating blocks.

``python -m benchmarks.interleave SPEC_JSON OUT_JSON WORKDIR`` on every rank (torchrun-style
environment; ``benchmarks.run`` starts it). The worker builds every variant of the spec (the same
model, data and optimizer), warms each up, then runs ``rounds`` rounds (with ``budget_s``: whole cycles of
rounds until that many seconds have passed, ``rounds`` at most); in round r the variants run
one block of ``steps`` optimizer steps each, in a balanced order (:func:`round_order`), both ranks starting
each block together (a barrier, outside the timed steps). A step's time is the slower rank's, so
the compute floor, which never synchronizes, is timed like the others. Rank 0 writes every step
time of every block; ``benchmarks.stats`` turns them into per-round ratios.

Why one process pair for everything: separate launches land on different CPU placements, cache
and allocator states and machine load, which moved a variant by +-20 % between launches here;
inside one pair, drift during the run falls on every variant alike (a balanced order spreads it evenly
over positions and predecessors: :func:`round_order`), so per-round ratios are tight even when absolute
times move.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.cases import BenchData, Spec
from benchmarks.device import Clock, bus_bandwidth, join, step_seconds, worker_main
from benchmarks.stats import REFERENCE
from benchmarks.variants import HAND_WRITTEN, DistaccumTrainer, Variant, build_variant

LEDGER_FIELDS = ("time_s", "data_s", "compute_s", "comm_s", "comm_exposed_s", "optim_s", "comm_calls",
                 "comm_bytes", "comm_rounds")
"""distaccum's own per-step record fields summarized next to the timings (where its time goes)."""


def round_order(order: Iterable[str], r: int) -> list[str]:
    """Round ``r``'s order: row ``r`` of a Williams design over the first order. Over len(order) rounds (twice
    that for an odd count) every variant takes every position equally often AND follows every other variant
    equally often, so neither the position in a round (drift within it) nor the variant run just before (the
    caches and allocator it leaves: a compiled variant's heap, a 27M-parameter model's gradients) favours one
    variant. A plain rotation kept the neighbours fixed: distaccum always ran right after the same variant."""
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


def slowest_rank(local: list[float]) -> list[float]:
    """Per step, the largest time over ranks (collective; outside the timed steps)."""
    gathered: list[list[float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return [max(times) for times in zip(*gathered, strict=True)]  # type: ignore[misc]


def timed_block(variant: Variant, steps: int, clock: Clock) -> list[float]:
    """One block of ``steps`` optimizer steps; returns the slower rank's time of each."""
    dist.barrier()
    stamps = variant.run(steps)
    clock.sync()
    return slowest_rank(step_seconds(clock, stamps))


def flat(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The parameters as one float64 CPU vector."""
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])


def reference_of(names: list[str]) -> str | None:
    """The variant the others' trained parameters are compared with: :data:`REFERENCE` when it ran, else the first
    hand-written loop that ran (a run of the compiled pair alone: ``ddp_no_sync_compiled``), else None. Never the
    compute floor, which must differ."""
    if REFERENCE in names:
        return REFERENCE
    return next((n for n in names if n in HAND_WRITTEN and n != "compute_floor"), None)


def parameter_agreement(variants: dict[str, Variant], ref: str | None) -> dict[str, float]:
    """Largest |difference| of each variant's trained parameters from ``ref``'s (:func:`reference_of`; None: nothing
    to compare with), relative to the largest |parameter|: ~1e-7 or less when every variant did the same arithmetic
    on the same data. The compute floor averages nothing over ranks, so it must differ (a negative control)."""
    if ref is None:
        return {}
    reference = flat(variants[ref].parameters())
    scale = float(reference.abs().max()) or 1.0
    out: dict[str, float] = {}
    for name, variant in variants.items():
        params = flat(variant.parameters())  # collective for sharded engines: every rank iterates
        if params.shape != reference.shape:
            out[name] = float("inf")
        else:
            out[name] = float((params - reference).abs().max()) / scale
    return out


def ledger_medians(variant: Variant, warmup: int) -> dict[str, float]:
    """Medians of distaccum's own per-step record fields over the timed steps."""
    if not isinstance(variant, DistaccumTrainer):
        return {}
    records = variant.records[warmup:]
    return {key: statistics.median(float(r[key]) for r in records)
            for key in LEDGER_FIELDS if records and all(key in r for r in records)}


def measure(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Build, warm up and interleave every variant of ``spec``; returns rank 0's record."""
    device, clock = join(spec.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = BenchData(spec, world)
    variants = {name: build_variant(name, spec, data, rank, device, clock, workdir) for name in spec.variants}
    for variant in variants.values():  # allocation, DDP's bucket rebuild, first optimizer step: untimed
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
    ledger = {name: ledger_medians(v, spec.warmup) for name, v in variants.items()}
    numel = spec.shape.num_params()
    busbw = bus_bandwidth(numel, device, clock) if device.type == "cuda" else None
    for variant in variants.values():
        variant.close()
    return {
        "spec": json.loads(spec.to_json()),
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "orders": orders,
        "step_s": blocks,
        "param_rel_diff": agreement,
        "param_reference": reference,
        "distaccum_ledger": {k: v for k, v in ledger.items() if v},
        "busbw": busbw,
    }


def main(argv: list[str] | None = None) -> None:
    """Worker entry: ``SPEC_JSON OUT_JSON WORKDIR``; rank 0 writes the record to OUT_JSON."""
    worker_main("benchmarks.interleave", measure, Spec.from_json, argv)


if __name__ == "__main__":
    main()
