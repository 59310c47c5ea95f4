"""Resuming a run: find the newest valid checkpoint, classify what the configuration changed since, restore it.

Used by the Trainer on every rank (collective) and, before any worker starts, by the CLI's
pre-flight (:func:`check_resumable`, single process), so an incompatible or corrupt checkpoint, or a
change a resume may not make (:mod:`distaccum.rundir.changes`), is an exit-2 message rather than a
traceback from every worker. The changes a resume accepts are printed once, by rank 0, when it resumes.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from distaccum.loop import TrainState
from distaccum.optim import LrSchedule, schedule_of
from distaccum.rundir import RANKS, read_metrics, truncate_metrics
from distaccum.rundir.changes import EXPLICIT, HORIZON, REFUSED, Change, classify, of_kind, refusal, report
from distaccum.rundir.checkpoint import (
    checkpoint_root,
    latest_valid,
    read_manifest,
    read_trainer_state,
    restore,
    saved_identity,
    warn_skipped,
)
from distaccum.rundir.liveness import previous_attempt

FRESH_START = (
    "start afresh with trainer.resume=false (its checkpoints are deleted) or choose a new run_dir; or, to keep the "
    "trained weights with the new setting, start a new run_dir with trainer.init_from=<this run_dir>/final (its "
    "model, not its optimizer state or data position)"
)


class ResumeError(ValueError):
    """The run directory holds checkpoints this configuration cannot resume."""


def check_resumable(
    run_dir: Path, identity: dict[str, Any], schedule_on_resume: str | None = None
) -> Path | None:
    """The checkpoint a resume of ``run_dir`` would use, after checking the configuration's run identity
    ``identity`` against the checkpoint's (:func:`resumable`)."""
    return resumable(run_dir, identity, schedule_on_resume)[0]


def resumable(
    run_dir: Path, identity: dict[str, Any], schedule_on_resume: str | None = None
) -> tuple[Path | None, list[Change]]:
    """The checkpoint a resume of ``run_dir`` would use and the settings that changed since it was written.

    Raises :class:`ResumeError` with one paragraph per refused change (:mod:`distaccum.rundir.changes`),
    for a moved horizon of a decaying schedule without ``trainer.schedule_on_resume``, or naming the paths
    when checkpoints exist but none is valid. Newer corrupt checkpoints are skipped with a warning.
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
        return None, []
    warn_skipped(found)
    saved = saved_identity(read_manifest(found.path))
    changes = classify(saved, identity)
    problems = [refusal(change, fresh_start=FRESH_START) for change in of_kind(changes, REFUSED)]
    if of_kind(changes, EXPLICIT) and schedule_on_resume is None:
        problems.append(horizon_choice(found.path, saved, identity))
    if problems:
        raise ResumeError(f"cannot resume {found.path}:\n" + "\n".join(problems))
    return found.path, changes


def horizon_choice(path: Path, saved: dict[str, Any], now: dict[str, Any]) -> str:
    """The paragraph for a resume that moves a decaying schedule's horizon without saying how."""
    old, new = int(saved[HORIZON]), int(now[HORIZON])
    trainer_state = read_trainer_state(path)
    done = int(trainer_state["steps_done"])
    scheduler = trainer_state.get("scheduler", {})
    kept = (
        LrSchedule.from_state(scheduler["lr_lambdas"][0]) if scheduler.get("lr_lambdas", [None])[0] else None
    )
    lr = float(saved["optim.lr"])  # the schedule the checkpoint followed
    if kept is None:  # a checkpoint from before the schedule was saved: the one its configuration describes
        return (
            f"{HORIZON} changed ({old} in the checkpoint, {new} now) under the {now['optim.schedule']} schedule, "
            f"whose decay ends at {HORIZON}: say how to continue with trainer.schedule_on_resume=keep or "
            "trainer.schedule_on_resume=stretch (see docs/failures.md#resuming)."
        )
    naive = LrSchedule.from_state({**scheduler["lr_lambdas"][0], "segments": [[0, new, 1.0]]})
    jump = max(range(done, new), key=naive, default=done)
    floor = f"{lr * kept.scale(new) * kept.floor:.2e}"
    if done < kept.horizon:
        keep = f"down to its final {floor} at step {kept.horizon}, then at it to step {new}"
        same = ""
    else:
        keep = f"at its final {floor} to step {new}"
        same = f"; the two are the same here: the schedule already ended at step {kept.horizon}"
    return (
        f"{HORIZON} changed ({old} in the checkpoint, {new} now) under the {now['optim.schedule']} schedule, which "
        f"decays the learning rate to its final {floor} at step {kept.horizon}; the checkpoint is after step {done}. "
        f"Re-stretching the whole schedule over {new} steps would silently move the learning rate back up "
        f"({lr * naive(jump):.2e} at step {jump + 1}), so say how to continue: trainer.schedule_on_resume=keep "
        f"continues the original schedule ({keep}); trainer.schedule_on_resume=stretch re-stretches it from here "
        f"(from {lr * kept(done):.2e} at step {done + 1} down to {floor} at step {new}){same}."
    )


def fresh_start(run_dir: Path) -> None:
    """``trainer.resume=false``: drop the run directory's checkpoints and rank files (rank 0)."""
    shutil.rmtree(checkpoint_root(run_dir), ignore_errors=True)
    shutil.rmtree(Path(run_dir) / RANKS, ignore_errors=True)


def resume(
    state: TrainState,
    run_dir: Path,
    identity: dict[str, Any],
    *,
    attempt: int,
    schedule_on_resume: str | None = None,
) -> int:
    """Restore the newest valid checkpoint of ``run_dir`` into ``state`` (collective); returns the
    optimizer steps it holds (0: none, start from the beginning). Rank 0 checks and chooses; every
    rank loads the same one and applies the same schedule choice."""
    rank = dist.get_rank()
    changes: list[Change] = []
    choice: list[Any] = [None, None, None]  # path, error, the horizon a decaying schedule had
    if rank == 0:
        try:
            path, changes = resumable(run_dir, identity, schedule_on_resume)
            choice[0] = str(path) if path else None
            choice[2] = next((c.saved for c in of_kind(changes, EXPLICIT)), None)
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
    schedule = schedule_of(state.scheduler)
    if choice[2] is not None and schedule is not None:  # the horizon moved: keep or stretch, as chosen
        if not trainer_state["scheduler"].get("lr_lambdas", [None])[0]:  # saved before schedules were kept
            schedule.segments = [[0, int(choice[2]), 1.0]]
        if schedule_on_resume == "stretch":
            schedule.stretch(done, int(identity[HORIZON]))
    if rank == 0:
        truncate_metrics(run_dir, done)
        lost = max(reached - done, 0)
        horizon = int(identity.get(HORIZON, 0))
        if horizon and done >= horizon:  # a rerun of a finished run: say so, rather than "resumed ... done"
            print(
                f"distaccum: {run_dir} already finished: its last checkpoint is after optimizer step {done} of "
                f"{HORIZON}={horizon}, so there is nothing left to train (raise {HORIZON} to continue it, or set "
                "trainer.resume=false to start it over)",
                flush=True,
            )
        else:
            print(
                f"distaccum: resumed from {path} after optimizer step {done}"
                + (f"; {lost} step(s) finished after it are recomputed" if lost else ""),
                flush=True,
            )
        if changes:
            print(report(changes, done, schedule_on_resume), flush=True)
        if attempt > 0:
            failures = previous_attempt(run_dir, attempt) or ["no rank left a record of the failure"]
            print(
                f"distaccum: elastic restart {attempt}: " + "; ".join(failures), file=sys.stderr, flush=True
            )
    dist.barrier()  # metrics.jsonl is truncated before any rank reads it
    state.records = [r for r in read_metrics(run_dir) if int(r["step"]) <= done]
    return done
