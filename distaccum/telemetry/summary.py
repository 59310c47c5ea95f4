"""The run summary: medians of the per-step records and fp64 digests (sum, sum of squares) of the final parameters."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from statistics import median
from typing import Any, Protocol

import torch

from distaccum.rundir import Record


class Trained(Protocol):
    """What the summary reads of the run's engine (:class:`~distaccum.engines.base.Engine`): the full parameters and
    the optimizer."""

    optimizer: torch.optim.Optimizer

    def full_parameters(self) -> Iterable[tuple[str, torch.Tensor]]: ...


def run_samples(record: Record) -> int:
    """A step record's samples over the whole run: ``run_samples`` in an outer-synced run's record (whose
    ``samples`` count rank 0's island), else ``samples``, which in records written before the two were told apart
    counted every island too."""
    return int(record.get("run_samples", record.get("samples")) or 0)


def summarize(
    header: Record,
    records: list[Record],
    engine: Trained,
    run_dir: Path,
    *,
    warmup_steps: int,
    lr_scale: float,
) -> Record:
    """The run summary: ``header`` (what ran: :meth:`distaccum.resolve.ResolvedRun.summary_header`), medians
    of the records after ``warmup_steps``, the effective learning rate (the optimizer's own initial lr times
    ``lr_scale``) and fp64 digests of every final parameter (collective)."""
    param_sum = torch.zeros((), dtype=torch.float64)
    param_sq = torch.zeros((), dtype=torch.float64)
    for _, tensor in engine.full_parameters():
        t = tensor.detach().to("cpu", torch.float64)
        param_sum += t.sum()
        param_sq += (t * t).sum()
    steady = records[warmup_steps:] or records
    total_time = sum(r["time_s"] for r in records)

    def med(key: str) -> float:
        return median(r[key] for r in steady) if steady else 0.0

    summary: dict[str, Any] = {
        **header,
        # The optimizer's own lr (a user's optimizer factory may set another than optim.lr), scaled.
        "effective_lr": engine.optimizer.param_groups[0]["initial_lr"] * lr_scale,
        "steps": len(records),
        "final_loss": records[-1]["loss"] if records else float("nan"),
        "samples_per_s": sum(map(run_samples, records)) / total_time if total_time else 0.0,  # every island's
        "param_sum": float(param_sum),
        "param_l2": float(param_sq.sqrt()),
        "run_dir": str(run_dir),
    }
    for key in (
        "time_s",
        "data_s",
        "compute_s",
        "comm_s",
        "comm_exposed_s",
        "optim_s",
        "comm_calls",
        "comm_bytes",
        "comm_rounds",
        "comm_calls_replicate",
        "comm_bytes_replicate",
        "comm_rounds_replicate",
    ):
        summary[f"median_{key}"] = med(key)
    summary["peak_mem_bytes"] = max((r["peak_mem_bytes"] for r in records), default=0)
    if any("compile_s" in r for r in records):  # trainer.compile: compile time apart from the step medians
        summary["compile_s"] = sum(r.get("compile_s", 0.0) for r in records)
        summary["recompiles"] = sum(r.get("recompiles", 0) for r in records[warmup_steps:])
        summary["graph_breaks"] = max((r.get("graph_breaks", 0) for r in records), default=0)
    busy = summary["median_compute_s"] + summary["median_comm_exposed_s"]
    summary["comm_share"] = summary["median_comm_exposed_s"] / busy if busy > 0 else 0.0
    return summary
