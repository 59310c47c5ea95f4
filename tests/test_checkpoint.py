"""Checkpoints in-process on a one-rank gloo group: periodic and atomic, verified before use, corrupt
ones skipped, incompatible ones refused with the differing fields, failed writes leave the previous
one intact, and non-finite steps are skipped together and stop the run after too many."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from distaccum import losses
from distaccum.datasets import SyntheticRegression
from distaccum.loop import NonFiniteError
from distaccum.models import MLP
from distaccum.rundir.checkpoint import CheckpointError, candidates, checkpoint_root, latest_valid, problems
from distaccum.rundir.resume import ResumeError
from distaccum.testing import injected
from distaccum.testing.faults import FullDisk, NanLoss
from distaccum.trainer import Trainer

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("cpu_group")]  # conftest: one gloo rank


def trainer(run_dir: Path, width: int = 16, on_step: Any = None, **sections: Any) -> Trainer:
    cfg: dict[str, Any] = {
        "trainer": {"nproc": 1, "max_steps": 6, "check_every": 0, "checkpoint_every": 2, "save_final": False},
        "accum": {"micro_batch": 2, "steps": 2},
        "precision": "fp64",
        "log": {"console": "quiet"},
        "run_dir": str(run_dir),
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return Trainer(
        cfg,
        model=lambda: MLP(32, width, 2, 8),
        dataset=SyntheticRegression(64),
        loss=losses.mse,
        on_step=on_step,
    )


def params(t: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for _, p in t.state.engine.full_parameters()])


def test_periodic_checkpoints_are_complete_and_pruned(tmp_path: Path) -> None:
    trainer(tmp_path).fit()
    root = checkpoint_root(tmp_path)
    assert [p.name for p in candidates(root)] == ["step-00000006", "step-00000004"]  # keep_checkpoints=2
    assert not list(root.glob("*.tmp"))
    manifest = json.loads((root / "step-00000006" / "manifest.json").read_text())
    assert manifest["step"] == 6 and manifest["fingerprint"]["global_batch"] == 4
    assert {"trainer_state.json", "rng/rank-00000.pt", "model/.metadata"} <= set(manifest["files"])
    assert problems(root / "step-00000006") == []


def test_a_corrupt_latest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    trainer(tmp_path).fit()
    root = checkpoint_root(tmp_path)
    shard = next((root / "step-00000006" / "model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    found = latest_valid(root)
    assert found.path == root / "step-00000004"
    assert "has" in found.skipped[0] and "bytes, the manifest says" in found.skipped[0]
    resumed = trainer(tmp_path, trainer={"max_steps": 8})
    with pytest.warns(UserWarning, match="skipped unusable checkpoint"):
        state = resumed.setup()
    assert state.source.next_step == 4 and len(state.records) == 4


def test_no_valid_checkpoint_is_an_error_naming_the_paths(tmp_path: Path) -> None:
    trainer(tmp_path).fit()
    for path in candidates(checkpoint_root(tmp_path)):
        (path / "manifest.json").unlink()
    with pytest.raises(ResumeError, match="none is valid: .*step-00000006: no readable manifest.json"):
        trainer(tmp_path).setup()


def test_resume_is_bit_identical_and_allows_harmless_changes(tmp_path: Path) -> None:
    straight = trainer(tmp_path / "straight", trainer={"max_steps": 10}, optim={"schedule": "constant"})
    straight.fit()
    first = trainer(tmp_path / "split", trainer={"max_steps": 5}, optim={"schedule": "constant"})
    first.fit()  # finished: its last checkpoint (step 5) is kept next to final/
    more = trainer(
        tmp_path / "split",
        trainer={"max_steps": 10, "check_every": 3},
        optim={"schedule": "constant"},
        log={"warmup_steps": 2},
    )
    state = more.setup()
    assert state.source.next_step == 5
    more.fit()
    assert [r["step"] for r in state.records] == list(range(1, 11))
    assert torch.equal(params(more), params(straight))


@pytest.mark.parametrize(
    "change, field",
    [
        ({"width": 24}, "model:"),
        ({"accum": {"micro_batch": 4, "steps": 2}}, "global_batch: 4 in the checkpoint, 8 now"),
        ({"trainer": {"seed": 1}}, "trainer.seed: 0 in the checkpoint, 1 now"),
        ({"optim": {"name": "sgd"}}, "optim.name"),
    ],
)
def test_a_change_that_breaks_the_run_is_refused_naming_the_field(
    tmp_path: Path, change: dict, field: str
) -> None:
    trainer(tmp_path).fit()
    with pytest.raises(ResumeError) as err:
        trainer(tmp_path, **change).setup()
    assert field in str(err.value) and "trainer.resume=false" in str(err.value)


def test_resume_false_starts_afresh(tmp_path: Path) -> None:
    trainer(tmp_path).fit()
    fresh = trainer(tmp_path, width=24, trainer={"resume": False, "max_steps": 2})
    assert fresh.setup().source.next_step == 0
    fresh.fit()
    assert [p.name for p in candidates(checkpoint_root(tmp_path))] == ["step-00000002"]


def test_a_failed_write_leaves_the_previous_checkpoint_and_stops(tmp_path: Path) -> None:
    run = trainer(tmp_path)
    with (
        injected(FullDisk(step=4)),
        pytest.raises(CheckpointError, match="after step 4 failed .*No space left on device.*step-00000002"),
    ):
        run.fit()
    root = checkpoint_root(tmp_path)
    assert [p.name for p in candidates(root)] == ["step-00000002"] and problems(root / "step-00000002") == []
    assert not list(root.glob("*.tmp"))


def test_time_based_checkpoints(tmp_path: Path) -> None:
    trainer(
        tmp_path, trainer={"checkpoint_every": 0, "checkpoint_every_s": 1e-9, "keep_checkpoints": 10}
    ).fit()
    assert len(candidates(checkpoint_root(tmp_path))) == 6  # due at every step


def test_a_non_finite_step_is_skipped_and_leaves_the_model_as_it_was(tmp_path: Path) -> None:
    snapshots: list[torch.Tensor] = []

    def keep(state: Any, record: dict) -> None:
        snapshots.append(torch.cat([p.detach().flatten().clone() for _, p in state.engine.full_parameters()]))

    run = trainer(tmp_path, on_step=keep)
    with injected(NanLoss(step=3)):
        run.fit()
    records = run.state.records
    assert [(r["skipped"], r["nonfinite"]) for r in records] == [(False, False)] * 2 + [(True, True)] + [
        (False, False)
    ] * 3
    assert torch.equal(snapshots[2], snapshots[1])  # step 3 did not move the parameters
    assert run.state.scheduler.last_epoch == 5
    assert torch.isfinite(snapshots[-1]).all()


def test_too_many_non_finite_steps_stop_the_run_with_a_diagnosis(tmp_path: Path) -> None:
    run = trainer(tmp_path, trainer={"max_nonfinite_steps": 3})
    with injected(NanLoss(step=2, steps=3)), pytest.raises(NonFiniteError) as err:
        run.fit()
    message = str(err.value)
    assert "3 consecutive optimizer steps (up to step 4)" in message
    assert "the loss was non-finite on rank(s) 0" in message and "net.0.weight" in message
    assert [r["nonfinite"] for r in run.state.records] == [False, True, True, True]
