"""Resuming a run: find the newest valid checkpoint, check it fits the configuration, restore it.

Used by the Trainer on every rank (collective) and, before any worker starts, by the CLI's
pre-flight (:func:`check_resumable`, single process), so an incompatible or corrupt checkpoint is
an exit-2 message rather than a traceback from every worker.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distaccum.cluster.liveness import previous_attempt
from distaccum.loop import TrainState
from distaccum.rundir import RANKS, read_metrics, truncate_metrics
from distaccum.rundir.checkpoint import (
    checkpoint_root,
    fingerprint_differences,
    latest_valid,
    read_manifest,
    restore,
    warn_skipped,
)

FRESH_START = "start afresh with trainer.resume=false (its checkpoints are deleted) or choose a new run_dir"


class ResumeError(ValueError):
    """The run directory holds checkpoints this configuration cannot resume."""


def check_resumable(run_dir: Path, fingerprint: dict[str, Any]) -> Path | None:
    """The checkpoint a resume of ``run_dir`` would use, after checking it fits ``fingerprint``.

    Raises :class:`ResumeError` naming every differing field, or the paths when checkpoints exist
    but none is valid. Newer corrupt checkpoints are skipped with a warning.
    """
    root = checkpoint_root(run_dir)
    found = latest_valid(root)
    if found.path is None:
        if found.skipped:
            raise ResumeError(
                f"{root} holds checkpoints but none is valid: "
                + " | ".join(found.skipped)
                + f"; {FRESH_START}"
            )
        return None
    warn_skipped(found)
    saved = read_manifest(found.path).get("fingerprint", {})
    differences = fingerprint_differences(saved, fingerprint)
    if differences:
        raise ResumeError(
            f"cannot resume {found.path}: the configuration changed in ways that break the run: "
            + "; ".join(differences)
            + f". To train with the new settings, {FRESH_START}"
        )
    return found.path


def fresh_start(run_dir: Path) -> None:
    """``trainer.resume=false``: drop the run directory's checkpoints and rank files (rank 0)."""
    shutil.rmtree(checkpoint_root(run_dir), ignore_errors=True)
    shutil.rmtree(Path(run_dir) / RANKS, ignore_errors=True)


def resume(state: TrainState, run_dir: Path, fingerprint: dict[str, Any], *, attempt: int) -> int:
    """Restore the newest valid checkpoint of ``run_dir`` into ``state`` (collective); returns the
    optimizer steps it holds (0: none, start from the beginning). Rank 0 checks and chooses; every
    rank loads the same one."""
    rank = dist.get_rank()
    choice: list[Any] = [None, None]
    if rank == 0:
        try:
            path = check_resumable(run_dir, fingerprint)
            choice[0] = str(path) if path else None
        except ResumeError as err:
            choice[1] = str(err)
    dist.broadcast_object_list(choice, src=0)
    if choice[1]:
        raise ResumeError(choice[1])
    if choice[0] is None:
        return 0
    path = Path(choice[0])
    reached = max((int(r["step"]) for r in read_metrics(run_dir)), default=0) if rank == 0 else 0
    trainer_state = restore(state, path)
    done = int(trainer_state["steps_done"])
    if rank == 0:
        truncate_metrics(run_dir, done)
        lost = max(reached - done, 0)
        print(
            f"distaccum: resumed from {path} after optimizer step {done}"
            + (f"; {lost} step(s) finished after it are recomputed" if lost else ""),
            flush=True,
        )
        if attempt > 0:
            report = previous_attempt(run_dir, attempt) or ["no rank left a record of the failure"]
            print(f"distaccum: elastic restart {attempt}: " + "; ".join(report), file=sys.stderr, flush=True)
    dist.barrier()  # metrics.jsonl is truncated before any rank reads it
    state.records = [r for r in read_metrics(run_dir) if int(r["step"]) <= done]
    return done
