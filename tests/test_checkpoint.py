"""Checkpoints in-process on a one-rank gloo group: periodic and atomic, verified before use, corrupt
ones skipped, what a resume changes classified (allowed and reported, explicit for a decaying schedule's
horizon, refused with the key, both values and what to do), failed writes leave the previous one intact,
and non-finite steps are skipped together and stop the run after too many."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from distaccum import losses
from distaccum.config import RunConfig
from distaccum.datasets import SyntheticRegression
from distaccum.loop import NonFiniteError
from distaccum.models import MLP
from distaccum.optim import LrSchedule
from distaccum.resolve import run_identity
from distaccum.rundir.changes import ALLOWED, ALLOWED_KEYS, EXPLICIT, HORIZON, REFUSED, REFUSED_KEYS, classify
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
    assert manifest["step"] == 6 and manifest["identity"]["global_batch"] == 4
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
    resumed = trainer(tmp_path, trainer={"max_steps": 8, "schedule_on_resume": "stretch"})
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
        ({"optim": {"lr": 1e-3}}, "optim.lr: 0.003 in the checkpoint, 0.001 now"),
        ({"accum": {"loss_norm": "mean_per_micro"}}, 'accum.loss_norm: "global_count" in the checkpoint'),
        ({"data": {"shuffle": False}}, "data.shuffle: true in the checkpoint, false now"),
        ({"precision": "fp32"}, 'precision: "fp64" in the checkpoint, "fp32" now'),
    ],
)
def test_a_change_that_breaks_the_run_is_refused_naming_the_field(
    tmp_path: Path, change: dict, field: str
) -> None:
    trainer(tmp_path).fit()
    with pytest.raises(ResumeError) as err:
        trainer(tmp_path, **change).setup()
    assert field in str(err.value) and "trainer.resume=false" in str(err.value)
    # issue 56.10: the way to keep the weights and change the setting
    assert "trainer.init_from=<this run_dir>/final" in str(err.value)


def test_every_setting_has_a_class() -> None:
    """A setting added to RunConfig without a class here would be refused as unknown on every resume."""
    record = run_identity(RunConfig(), 2, {}, SyntheticRegression(8), MLP(4, 4, 1, 1))
    unclassified = [
        key
        for key in record
        if key != HORIZON
        and not any(
            key == k or (k.endswith(".") and key.startswith(k)) for k in {**ALLOWED_KEYS, **REFUSED_KEYS}
        )
    ]
    assert unclassified == []
    assert {c.kind for c in classify(record, {**record, "optim.lr": 1.0, "log.console": "quiet"})} == {
        REFUSED,
        ALLOWED,
    }
    assert classify(record, {**record, "invented.key": 1}) == []  # recorded on one side only: not compared
    assert [c.kind for c in classify({**record, "invented.key": 0}, {**record, "invented.key": 1})] == [
        REFUSED
    ]


def test_allowed_changes_resume_and_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trainer(tmp_path).fit()
    more = trainer(
        tmp_path,
        trainer={"max_steps": 6, "checkpoint_every": 3, "check_every": 2},
        accum={"micro_batch": 1, "steps": 4},  # the same global batch of 4
        log={"console": "bar"},
    )
    more.setup()
    out = capsys.readouterr().out
    assert "5 setting(s) changed since the checkpoint after optimizer step 6:" in out
    for line in (
        "allowed  accum.micro_batch: 2 -> 1 (the global batch is unchanged",
        "allowed  accum.steps: 2 -> 4",
        "allowed  trainer.checkpoint_every: 2 -> 3",
        'allowed  log.console: "quiet" -> "bar"',
    ):
        assert line in out


def test_a_checkpoint_recording_its_run_identity_under_the_old_name_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 57: the manifest's run identity was called ``fingerprint`` before; such a checkpoint is still compared
    with (a refused change is refused, an allowed one reported) and resumed."""
    trainer(tmp_path).fit()
    for path in checkpoint_root(tmp_path).glob("step-*/manifest.json"):
        manifest = json.loads(path.read_text())
        manifest["fingerprint"] = manifest.pop("identity")
        path.write_text(json.dumps(manifest))
    with pytest.raises(ResumeError) as err:
        trainer(tmp_path, optim={"lr": 1e-3}).setup()
    assert "optim.lr: 0.003 in the checkpoint, 0.001 now" in str(err.value)
    state = trainer(tmp_path, log={"console": "bar"}).setup()
    assert state.source.next_step == 6
    out = capsys.readouterr().out
    assert "1 setting(s) changed since the checkpoint after optimizer step 6:" in out
    assert 'allowed  log.console: "quiet" -> "bar"' in out


def test_rerunning_a_finished_run_says_it_is_finished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 56.10: the same command again on a finished run printed "resumed ... after optimizer step 6", then done."""
    trainer(tmp_path).fit()
    capsys.readouterr()
    again = trainer(tmp_path)
    again.setup()
    out = capsys.readouterr().out
    assert (
        f"{tmp_path} already finished: its last checkpoint is after optimizer step 6 of trainer.max_steps=6"
        in out
    )
    assert "resumed from" not in out
    assert again.train_steps() == []  # nothing left to train


def _lrs(run: Trainer) -> list[float]:
    return [r["lr"] for r in run.state.records]


def test_a_longer_run_under_a_decaying_schedule_must_say_how_to_continue(tmp_path: Path) -> None:
    """The trap: max_steps 6 -> 12 under cosine silently re-stretched the schedule, raising the lr again."""
    first = trainer(tmp_path, trainer={"checkpoint_every": 3})
    first.fit()
    floor = 3e-3 * 0.1  # optim.lr x optim.min_lr_ratio
    assert _lrs(first)[-1] == pytest.approx(floor)
    with pytest.raises(ResumeError) as err:
        trainer(tmp_path, trainer={"max_steps": 12}).setup()
    message = str(err.value)
    assert "trainer.max_steps changed (6 in the checkpoint, 12 now) under the cosine schedule" in message
    assert "trainer.schedule_on_resume=keep continues the original schedule" in message
    assert "trainer.schedule_on_resume=stretch re-stretches it from here" in message
    assert f"final {floor:.2e} at step 6" in message and "move the learning rate back up (" in message
    assert "the two are the same here: the schedule already ended at step 6" in message  # issue 56.10

    kept = trainer(tmp_path, trainer={"max_steps": 12, "schedule_on_resume": "keep"})
    kept.fit()
    assert _lrs(kept)[:6] == _lrs(first)
    assert _lrs(kept)[6:] == pytest.approx([floor] * 6, rel=1e-12)
    again = trainer(tmp_path, trainer={"max_steps": 14}, optim={})  # the kept schedule travels on
    with pytest.raises(ResumeError, match="12 in the checkpoint, 14 now"):
        again.setup()
    longer = trainer(tmp_path, trainer={"max_steps": 14, "schedule_on_resume": "stretch"})
    longer.fit()
    assert _lrs(longer)[12:] == pytest.approx([floor] * 2, rel=1e-12)  # stretched from the floor: flat


def test_stretch_decays_from_where_the_run_stopped(tmp_path: Path) -> None:
    first = trainer(tmp_path, trainer={"checkpoint_every": 3})
    first.fit()
    shutil.rmtree(checkpoint_root(tmp_path) / "step-00000006")  # resume from step 3, mid-decay
    stretched = trainer(tmp_path, trainer={"max_steps": 12, "schedule_on_resume": "stretch"})
    stretched.fit()
    lrs = _lrs(stretched)
    assert lrs[:3] == _lrs(first)[:3]
    assert lrs[3] == pytest.approx(_lrs(first)[3], rel=1e-12)  # continuous: no jump at the resume
    assert all(b <= a for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[-1] == pytest.approx(3e-4, rel=1e-12) and lrs[-2] > lrs[-1]
    schedule = LrSchedule.from_state(
        json.loads((checkpoint_root(tmp_path) / "step-00000012" / "trainer_state.json").read_text())[
            "scheduler"
        ]["lr_lambdas"][0]
    )
    assert schedule.segments[-1][:2] == [3, 12] and schedule.horizon == 12


def test_max_steps_under_a_constant_schedule_is_allowed(tmp_path: Path) -> None:
    trainer(tmp_path, optim={"schedule": "constant"}).fit()
    changes = classify({HORIZON: 6, "optim.schedule": "constant"}, {HORIZON: 8, "optim.schedule": "constant"})
    assert [c.kind for c in changes] == [ALLOWED]
    assert [c.kind for c in classify({HORIZON: 6}, {HORIZON: 8, "optim.schedule": "linear"})] == [EXPLICIT]
    run = trainer(tmp_path, trainer={"max_steps": 8}, optim={"schedule": "constant"})
    run.fit()
    assert len(run.state.records) == 8


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
