"""The engine-sweep worker: one variant at one K in fresh processes, for peak memory and the ledger.

``python -m benchmarks.sweep SPEC_JSON OUT_JSON WORKDIR`` on every rank. It builds the spec's one
variant (a distaccum engine variant, or the hand-written ``ddp_no_sync`` as a reference), runs the
warm-up and the timed steps one at a time, and reads after each step:

- the step's peak memory: process peak RSS (VmHWM, reset at the step's start) on CPU, the CUDA
  allocator's peak on GPU (``distaccum.telemetry.memory``, the same reading distaccum's records carry);
- distaccum's own per-step record: ``comm_rounds``, ``comm_calls``, ``comm_bytes`` (gradient
  reductions), ``gather_calls``/``gather_bytes`` (FSDP2 parameter all-gathers), ``time_s``, ...

Why fresh processes per engine and K: a process's peak RSS never goes down and glibc keeps freed
memory mapped, so whatever ran earlier in a process (another engine, another K) would set or
inflate the peak; the interleaved timing worker holds five models at once. Here each (engine, K)
owns its processes and nothing else ran in them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.cases import BenchData, Spec
from benchmarks.device import join, step_seconds, worker_main
from benchmarks.variants import DistaccumTrainer, Variant, build_variant
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory

RECORD_FIELDS = ("time_s", "comm_rounds", "comm_calls", "comm_bytes", "gather_calls", "gather_bytes", "comm_s",
                 "comm_exposed_s", "compute_s", "optim_s", "peak_mem_bytes", "comm_rounds_replicate",
                 "comm_calls_replicate", "comm_bytes_replicate")
"""distaccum's per-step record fields whose medians over the timed steps the sweep keeps."""


def largest_over_ranks(value: float) -> float:
    """The largest value over ranks (collective, outside the steps)."""
    gathered: list[float | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return max(v for v in gathered if v is not None)


def one_step(variant: Variant, device: torch.device) -> tuple[list[Any], int]:
    """One optimizer step with its own peak-memory window; returns its stamps and peak bytes.
    distaccum's loop resets the window itself when its step starts; the hand-written loop gets
    the same reset here."""
    reset_peak_memory(device)
    stamps = variant.run(1)
    return stamps, peak_memory_bytes(device)


def record_medians(variant: Variant, warmup: int) -> dict[str, float]:
    """Medians of distaccum's per-step record fields over the timed steps (empty for a baseline)."""
    if not isinstance(variant, DistaccumTrainer):
        return {}
    records = variant.records[warmup:]
    return {key: statistics.median(float(r[key]) for r in records)
            for key in RECORD_FIELDS if records and all(key in r for r in records)}


def measure(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Run the spec's one variant; returns the record (every value already reduced over ranks)."""
    device, clock = join(spec.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    (name,) = spec.variants
    data = BenchData(spec, world)
    variant = build_variant(name, spec, data, rank, device, clock, workdir)
    # Nothing has reset the peak yet: this is the process's peak through imports, data and set-up.
    setup_peak = peak_memory_bytes(device)
    warmup_peaks = [one_step(variant, device)[1] for _ in range(spec.warmup)]
    times, peaks = [], []
    for _ in range(spec.steps):
        stamps, peak = one_step(variant, device)
        clock.sync()
        times.append(step_seconds(clock, stamps)[0])
        peaks.append(peak)
    medians = record_medians(variant, spec.warmup)
    variant.close()
    step_peak = largest_over_ranks(max(peaks))
    return {
        "spec": json.loads(spec.to_json()),
        "variant": name,
        "world_size": world,
        "step_s": [largest_over_ranks(t) for t in times],
        "setup_peak_bytes": largest_over_ranks(setup_peak),
        "step_peak_bytes": step_peak,
        "process_peak_bytes": max(largest_over_ranks(max([setup_peak, *warmup_peaks])), step_peak),
        "records": medians,
    }


def main(argv: list[str] | None = None) -> None:
    """Worker entry: ``SPEC_JSON OUT_JSON WORKDIR``; rank 0 writes the record to OUT_JSON."""
    worker_main("benchmarks.sweep", measure, Spec.from_json, argv)


if __name__ == "__main__":
    main()
