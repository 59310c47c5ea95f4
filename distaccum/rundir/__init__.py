"""The run directory: the one module that names its files and reads them back.

run_dir/
  config.json          the resolved configuration (rank 0, at start)
  launch_config.json   what the local launcher handed its workers
  metrics.jsonl        one record per optimizer step, plus eval lines (rank 0, flushed as written)
  summary.json         the run summary (at the end)
  status.json          ok | failed | invalid_config, written by the CLI
  checkpoints/         step-NNNNNNNN/ checkpoints at window boundaries (see distaccum.rundir.checkpoint)
  ranks/               rank-NNNNN.json: each rank's last sign of life (see distaccum.rundir.liveness)
  param_digests.jsonl  per-step parameter digests (verify.record; checksums.jsonl before issue 57, still read)
  divergence.json      the cross-rank tripwire's (or the fingerprint's) report, when it fired
  warnings.jsonl       the runtime checks' warnings (identical data or random numbers on every rank)
  console.log          a verify sub-run's console output
  final/               the trained model: model.safetensors, run_config.json (+ HF layout)
  plan.json, plan.md   `distaccum plan`: measured costs, predictions, recommendation (+ trials/)
  sweep.sh             `distaccum plan --sweep`: the multirun command measuring every split
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

CONFIG = "config.json"
LAUNCH_CONFIG = "launch_config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
STATUS = "status.json"
CHECKPOINTS = "checkpoints"
RANKS = "ranks"
PARAM_DIGESTS = "param_digests.jsonl"
OLD_PARAM_DIGESTS = "checksums.jsonl"
"""The parameter digests' file name before issue 57 (read for one release, never written)."""
DIVERGENCE = "divergence.json"
WARNINGS = "warnings.jsonl"
CONSOLE_LOG = "console.log"
PLAN = "plan.json"
PLAN_TABLE = "plan.md"
SWEEP_SCRIPT = "sweep.sh"
FINAL_DIR = "final"
FINAL_WEIGHTS = "model.safetensors"
FINAL_CONFIG = "run_config.json"
SEED = "seed.safetensors"
"""A verify seed checkpoint: the initial weights every verify run loads through ``trainer.init_from``."""

Record = dict[str, Any]


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a reader never sees half a file, and several writers of the same
    file (the launchers of one elastic run sharing its run_dir, ranks on hosts sharing a filesystem) each go
    through a temporary file of their own, so none renames another's away; the last rename wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` as indented JSON atomically (:func:`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(value, indent=2, sort_keys=True) + "\n")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``, or {} when missing or unreadable."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def read_jsonl(path: Path) -> list[Record]:
    """Every JSON object line of ``path``; a torn last line (killed job) is skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def read_param_digests(run_dir: Path) -> dict[int, dict[str, list[float]]]:
    """``verify.record``'s per-step parameter digests: step -> parameter -> [sum, sum of squares, numel]
    (``param_digests.jsonl``, or ``checksums.jsonl`` as a run before issue 57 wrote it)."""
    path = run_dir / PARAM_DIGESTS
    if not path.exists():
        path = run_dir / OLD_PARAM_DIGESTS
    return {row["step"]: row["params"] for row in read_jsonl(path)}


def read_metrics(run_dir: Path) -> list[Record]:
    """Per-step records sorted by step; a step logged twice (a resumed run) keeps its last record."""
    by_step: dict[int, Record] = {}
    for record in read_jsonl(Path(run_dir) / METRICS):
        if "step" in record and "loss" in record:
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def read_evals(run_dir: Path) -> list[Record]:
    """The evaluation lines of ``metrics.jsonl`` (``eval_loss``, ``eval_ppl``; ``step`` = optimizer steps
    done when it ran, 0 before training), sorted by step; a step evaluated twice keeps its last line."""
    by_step: dict[int, Record] = {}
    for record in read_jsonl(Path(run_dir) / METRICS):
        if "step" in record and "eval_loss" in record:
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def truncate_metrics(run_dir: Path, steps: int) -> list[Record]:
    """Keep the first ``steps`` step records of ``metrics.jsonl`` and the evaluations up to them (a
    resumed run drops later lines); return the step records."""
    path = Path(run_dir) / METRICS
    records = [r for r in read_metrics(run_dir) if int(r["step"]) <= steps]
    evals = [r for r in read_evals(run_dir) if int(r["step"]) <= steps]
    lines = sorted(
        [(int(r["step"]), 0, r) for r in records] + [(int(r["step"]), 1, r) for r in evals],
        key=lambda line: line[:2],
    )
    if path.is_file():
        path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for _, _, r in lines), encoding="utf-8")
    return records


def read_warnings(run_dir: Path) -> list[Record]:
    """The runtime checks' warnings of a run (``warnings.jsonl``: step, check, message), in order."""
    return read_jsonl(Path(run_dir) / WARNINGS)


def read_config(run_dir: Path) -> dict[str, Any]:
    """The resolved configuration a run wrote to ``config.json`` (its ``components`` note dropped), as
    the mapping :func:`distaccum.config.from_mapping` builds a ``RunConfig`` from."""
    values = read_json(Path(run_dir) / CONFIG)
    if not values:
        raise ValueError(f"{run_dir}: no readable {CONFIG}")
    values.pop("components", None)
    return values


def final_weights(run_dir: Path) -> Path:
    """Where a finished run keeps its trained weights."""
    return Path(run_dir) / FINAL_DIR / FINAL_WEIGHTS


def resolve_weights(path: str | Path) -> Path:
    """A weights file from a file path or a directory holding ``model.safetensors`` (a run's final/)."""
    candidate = Path(path)
    if candidate.is_dir():
        candidate = candidate / FINAL_WEIGHTS
    return candidate
