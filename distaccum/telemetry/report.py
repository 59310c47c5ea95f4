"""Compare finished runs and sweeps: one row a run, a loss-curve agreement check.

Everything here is a pure function of the run directories (``metrics.jsonl`` with its held-out
evaluation lines, ``summary.json``, ``status.json``, ``config.json``, Hydra's ``.hydra/overrides.yaml``);
:mod:`distaccum.telemetry.markdown` writes it as ``report.md`` and :mod:`distaccum.telemetry.figure` draws it.
``distaccum report`` (:mod:`distaccum.cli.report`) wires them.

Loss-curve agreement: runs are comparable when they train the same model on the same data with the
same optimizer, precision, seed and effective batch (samples per optimizer step) — i.e. they differ
only in the split, the engine, the sync mode, the loss normalization or activation checkpointing.
Within each such group the reference is the medoid (smallest summed distance to the others) and a
run agrees when every common step satisfies ``|loss - ref| <= atol + rtol * |ref|``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

import yaml

from distaccum.config import OptimConfig
from distaccum.rundir import (
    CONFIG,
    METRICS,
    STATUS,
    SUMMARY,
    Record,
    read_evals,
    read_json,
    read_metrics,
)
from distaccum.telemetry.summary import run_samples

RUN_FILES = (METRICS, SUMMARY, STATUS)
COMPARABLE_SECTIONS = ("model", "data", "loss", "optim", "precision")
"""Config sections that must be equal for two loss curves to be expected to agree."""


@dataclass
class Run:
    """One run directory as found on disk."""

    path: Path
    label: str
    status: str
    """ok | failed | invalid_config | incomplete (no summary yet) | ... as in ``status.json``."""
    error: str = ""
    records: list[Record] = field(default_factory=list)
    summary: Record = field(default_factory=dict)
    config: Record = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    evals: list[Record] = field(default_factory=list)
    """Held-out evaluations (``eval_loss``, ``eval_ppl``) by optimizer steps done."""

    @property
    def losses(self) -> dict[int, float]:
        """step -> loss."""
        return {int(r["step"]): float(r["loss"]) for r in self.records}

    @property
    def eval_losses(self) -> dict[int, float]:
        """step -> held-out eval loss."""
        return {int(r["step"]): float(r["eval_loss"]) for r in self.evals}


@dataclass
class Agreement:
    """How one run's loss curve compares with its group's reference."""

    label: str
    reference: str
    steps: int
    max_rel_diff: float
    first_bad_step: int | None

    @property
    def ok(self) -> bool:
        return self.first_bad_step is None


@dataclass
class Row:
    """One table row: medians over the steps after warm-up."""

    label: str
    status: str
    varied: str
    split: str
    engine: str
    sync: str
    loss_norm: str
    steps: int
    effective_lr: float
    """The learning rate after ``optim.lr_scaling`` (before warmup and decay)."""
    samples_per_s: float
    data_s: float
    compute_s: float
    comm_s: float
    comm_exposed_s: float
    optim_s: float
    comm_share: float
    comm_bytes: float
    comm_calls: float
    peak_mem_bytes: int
    final_loss: float
    eval_loss: float = math.nan
    """The last held-out evaluation's loss (nan without one)."""
    agreement: str = "-"
    comm_bytes_replicate: float = math.nan
    """HSDP: bytes all-reduced across replicas per step (0 on flat engines; nan for older runs)."""
    comm_calls_replicate: float = math.nan
    outer_bytes: float = math.nan
    """An outer-synced run: bytes one rank sent across the islands per step, averaged over every step (most steps
    send nothing; a sync sends a fragment); nan without an outer sync."""
    outer_syncs: int = 0


# ---------------------------------------------------------------- loading


def is_run_dir(path: Path) -> bool:
    """A directory written by one ``distaccum train`` run (or one sweep job)."""
    return any((path / name).is_file() for name in RUN_FILES)


def load_run(path: Path, label: str | None = None) -> Run:
    """Read one run directory; missing files give an incomplete or failed run, never an exception."""
    status_file = read_json(path / STATUS)
    summary = read_json(path / SUMMARY)
    status = status_file.get("status") or ("ok" if summary else "incomplete")
    if status == "ok" and not summary:
        status = "incomplete"
    error = str(status_file.get("error") or "")
    if not error and status == "failed":
        error = f"exit code {status_file.get('exit_code')}"
    overrides_file = path / ".hydra" / "overrides.yaml"
    overrides: list[str] = []
    if overrides_file.is_file():
        loaded = yaml.safe_load(overrides_file.read_text(encoding="utf-8"))
        overrides = [str(o) for o in loaded or []]
    return Run(
        path=path,
        label=label or path.name,
        status=status,
        error=error,
        records=read_metrics(path),
        summary=summary,
        config=read_json(path / CONFIG),
        overrides=overrides,
        evals=read_evals(path),
    )


def sweep_jobs(path: Path) -> list[Path]:
    """Job directories of a Hydra multirun directory, in job-number order."""
    jobs = [p for p in path.iterdir() if p.is_dir() and is_run_dir(p)]
    return sorted(jobs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def discover(paths: list[Path]) -> list[Run]:
    """Runs for each path: a run directory, or a sweep directory expanded into its jobs.

    Raises ValueError for a path that is neither.
    """
    runs: list[Run] = []
    for path in paths:
        if is_run_dir(path):
            runs.append(load_run(path))
            continue
        jobs = sweep_jobs(path) if path.is_dir() else []
        if not jobs:
            raise ValueError(
                f"{path}: not a run directory (no {', '.join(RUN_FILES)}) "
                "and not a sweep directory holding any"
            )
        prefix = f"{path.name}/" if len(paths) > 1 else ""
        runs.extend(load_run(job, f"{prefix}{job.name}") for job in jobs)
    for run, varied in zip(runs, varied_overrides(runs), strict=True):
        run.overrides = varied
    seen: dict[str, int] = {}
    for run in runs:  # labels name runs in the table and the agreement check: keep them unique
        seen[run.label] = seen.get(run.label, 0) + 1
        if seen[run.label] > 1:
            run.label = f"{run.label}#{seen[run.label]}"
    return runs


def varied_overrides(runs: list[Run]) -> list[list[str]]:
    """Per run, the Hydra overrides not shared by every run (``run_dir=`` and ``hydra.`` left out):
    what tells the runs of a sweep, or runs compared side by side, apart."""
    common = set.intersection(*(set(r.overrides) for r in runs)) if runs else set()
    return [
        [o for o in r.overrides if o not in common and not o.lstrip("+~").startswith(("run_dir=", "hydra."))]
        for r in runs
    ]


# ---------------------------------------------------------------- table


def _split(run: Run) -> str:
    """The split of the run's last step, and the global batches it went through when it changed."""
    s = run.summary
    if {"micro_batch", "accum_steps", "world_size", "global_batch"} <= s.keys():
        batches = [int(batch) for _, batch in s.get("batch_phases", [])]
        phases = f" ({' -> '.join(map(str, batches))})" if len(batches) > 1 else ""
        return f"{s['micro_batch']}x{s['accum_steps']}x{s['world_size']}={s['global_batch']}{phases}"
    return "-"


def effective_lr(run: Run) -> float:
    """``summary.json``'s ``effective_lr``; for runs without one, ``optim.lr`` x the scaling of the
    global batch their config and first record give (nan when unknown)."""
    if "effective_lr" in run.summary:
        return float(run.summary["effective_lr"])
    global_batch = run.summary.get("global_batch") or (run_samples(run.records[0]) if run.records else None)
    try:
        optim = OptimConfig(**run.config["optim"])
    except (KeyError, TypeError, ValueError):
        return math.nan
    return optim.lr * optim.lr_scale(int(global_batch)) if global_batch else math.nan


def table_row(run: Run) -> Row:
    """Medians over the run's steady steps (``log.warmup_steps`` dropped, default 1)."""
    warmup = int(run.config.get("log", {}).get("warmup_steps", 1))
    steady = run.records[warmup:] or run.records
    accum = run.config.get("accum", {})

    def med(key: str) -> float:
        values = [float(r[key]) for r in steady if key in r]
        return median(values) if values else math.nan

    total_time = sum(float(r.get("time_s", 0.0)) for r in run.records)
    samples = sum(map(run_samples, run.records))
    compute, exposed = med("compute_s"), med("comm_exposed_s")
    busy = compute + exposed
    return Row(
        label=run.label,
        status=run.status,
        varied=" ".join(run.overrides),
        split=_split(run),
        engine=str(run.summary.get("engine", run.config.get("engine", {}).get("name", "-"))),
        sync=str(run.summary.get("sync", accum.get("sync", "-"))),
        loss_norm=str(run.summary.get("loss_norm", accum.get("loss_norm", "-"))),
        steps=len(run.records),
        effective_lr=effective_lr(run),
        samples_per_s=samples / total_time if total_time > 0 else math.nan,
        data_s=med("data_s"),
        compute_s=compute,
        comm_s=med("comm_s"),
        comm_exposed_s=exposed,
        optim_s=med("optim_s"),
        comm_share=exposed / busy if busy > 0 else math.nan,
        comm_bytes=med("comm_bytes"),
        comm_calls=med("comm_calls"),
        peak_mem_bytes=max((int(r.get("peak_mem_bytes", 0)) for r in run.records), default=0),
        comm_bytes_replicate=med("comm_bytes_replicate"),
        comm_calls_replicate=med("comm_calls_replicate"),
        outer_bytes=(
            sum(float(r.get("comm_bytes_outer", 0)) for r in run.records) / len(run.records)
            if run.records and any("comm_bytes_outer" in r for r in run.records)
            else math.nan
        ),
        outer_syncs=sum(int(r.get("outer_synced", 0)) for r in run.records),
        final_loss=float(run.records[-1]["loss"]) if run.records else math.nan,
        eval_loss=float(run.evals[-1]["eval_loss"]) if run.evals else math.nan,
    )


def gns_series(run: Run) -> dict[int, tuple[float, float]]:
    """step -> (raw, smoothed) gradient noise scale, for runs trained with ``log.gns=true``."""
    return {
        int(r["step"]): (float(r["gns"]), float(r["gns_smoothed"]))
        for r in run.records
        if "gns_smoothed" in r
    }


# ---------------------------------------------------------------- agreement


def comparable_key(run: Run) -> str:
    """Runs with equal keys should produce the same loss curve (up to floating-point rounding)."""
    config = run.config
    key = {name: config.get(name) for name in COMPARABLE_SECTIONS}
    if isinstance(key["data"], dict):  # how samples are loaded does not change what they are
        key["data"] = {k: v for k, v in key["data"].items() if k not in ("num_workers", "prefetch_factor")}
    if isinstance(key["model"], dict):  # recomputing activations does not change a single value
        key["model"] = {k: v for k, v in key["model"].items() if k != "activation_checkpointing"}
    key["seed"] = config.get("trainer", {}).get("seed")
    key["samples_per_step"] = run_samples(run.records[0]) if run.records else None
    # What changes the math besides the sections: an outer sync (a DiLoCo run is not its synchronous baseline), and
    # a global batch that changes as the run goes (a ramp, the adaptive rule), whatever its first step takes.
    outer = config.get("outer") or {}
    key["outer"] = outer if outer.get("method", "none") != "none" else None
    accum = config.get("accum") or {}
    adaptive = accum.get("adaptive") or {}
    key["batch_growth"] = {
        "ramp": accum.get("ramp"),
        "adaptive": adaptive if adaptive.get("enabled") else None,
    }
    return json.dumps(key, sort_keys=True, default=str)


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to |b| (absolute when b is 0)."""
    return abs(a - b) / abs(b) if b else abs(a - b)


def _max_rel_diff(a: dict[int, float], b: dict[int, float]) -> float:
    common = a.keys() & b.keys()
    return max((rel_diff(a[s], b[s]) for s in common), default=0.0)


def compare_curves(
    cand: dict[int, float], ref: dict[int, float], rtol: float, atol: float
) -> tuple[float, int | None, int]:
    """(max relative difference, first step out of tolerance or None, steps compared)."""
    common = sorted(cand.keys() & ref.keys())
    first_bad = next((s for s in common if abs(cand[s] - ref[s]) > atol + rtol * abs(ref[s])), None)
    return _max_rel_diff(cand, ref), first_bad, len(common)


def check_agreement(runs: list[Run], rtol: float, atol: float) -> list[Agreement]:
    """Compare every run that has steps with its comparable group's medoid; a run alone in its group
    is not reported."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        if run.records:
            groups.setdefault(comparable_key(run), []).append(run)
    results: list[Agreement] = []
    for group in groups.values():
        if len(group) < 2:
            continue
        curves = [r.losses for r in group]
        spread = [sum(_max_rel_diff(c, o) for o in curves) for c in curves]
        ref = group[spread.index(min(spread))]
        for run in group:
            if run is ref:
                continue
            worst, first_bad, steps = compare_curves(run.losses, ref.losses, rtol, atol)
            results.append(Agreement(run.label, ref.label, steps, worst, first_bad))
    return results


def build_rows(runs: list[Run], agreements: list[Agreement]) -> list[Row]:
    """Table rows with the agreement column filled in."""
    by_label = {a.label: a for a in agreements}
    refs = {a.reference for a in agreements}
    digests = {run.label: str(run.summary.get("params_sha256") or "") for run in runs}  # accum.exact's hash
    rows = []
    for run in runs:
        row = table_row(run)
        digest = digests[run.label]
        if run.label in refs:
            row.agreement = f"reference (sha256 {digest[:12]})" if digest else "reference"
        elif run.label in by_label:
            a = by_label[run.label]
            row.agreement = (
                f"bitwise (sha256 {digest[:12]})"
                if digest and digest == digests[a.reference]  # the same trained parameters, bit for bit
                else f"ok ({a.max_rel_diff:.1e})"
                if a.ok
                else f"DISAGREES at step {a.first_bad_step} ({a.max_rel_diff:.1e})"
            )
        rows.append(row)
    return rows
