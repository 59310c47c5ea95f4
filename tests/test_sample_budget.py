"""``trainer.max_samples`` (issue 58.5): the run ends after the optimizer step whose samples bring its total to N or
past it, whatever each step's global batch, in one call, in chunks and across a resume; refused with an outer sync.
In-process on a one-rank gloo group (conftest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from distaccum import losses
from distaccum.config import from_mapping
from distaccum.datasets import SyntheticRegression
from distaccum.models import MLP
from distaccum.runtime.stopping import StopFlag, StopRequested
from distaccum.trainer import Trainer

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("cpu_group")]

RAMP = {"micro_batch": 2, "global_batch": 8, "ramp": {"points": [[1, 4], [3, 8]]}}
"""Steps 1-2 take 4 samples, then 8: the run's total is 4, 8, 16, 24, 32, ... after steps 1, 2, 3, 4, 5."""


def trainer(run_dir: Path, max_samples: int | None, max_steps: int = 20, **extra: Any) -> Trainer:
    cfg = {
        "trainer": {
            "nproc": 1,
            "max_steps": max_steps,
            "max_samples": max_samples,
            "check_every": 0,
            "save_final": False,
            "checkpoint_every": 0,
        },
        "accum": RAMP,
        "log": {"console": "quiet"},
        "run_dir": str(run_dir),
    }
    return Trainer(
        cfg, model=lambda: MLP(32, 16, 2, 8), dataset=SyntheticRegression(256), loss=losses.mse, **extra
    )


@pytest.mark.parametrize(("budget", "last"), [(8, 2), (9, 3), (16, 3), (17, 4), (1, 1)])
def test_the_run_ends_after_the_step_whose_samples_reach_or_pass_the_budget(
    tmp_path: Path, budget: int, last: int
) -> None:
    t = trainer(tmp_path, budget)
    t.fit()
    records = t.state.records
    assert [r["step"] for r in records] == list(range(1, last + 1))
    assert [r["samples"] for r in records] == [4, 4, 8, 8][:last]
    total = sum(r["samples"] for r in records)
    assert total >= budget > total - records[-1]["samples"]  # the step before had not reached it


def test_max_steps_still_bounds_it_and_no_budget_is_max_steps_alone(tmp_path: Path) -> None:
    t = trainer(tmp_path / "bounded", 10_000, max_steps=5)
    t.fit()
    assert len(t.state.records) == 5
    t = trainer(tmp_path / "none", None)
    t.fit()
    assert len(t.state.records) == 20


def test_training_in_chunks_and_a_resume_count_the_steps_already_run(tmp_path: Path) -> None:
    chunks = trainer(tmp_path / "chunks", 17)
    assert len(chunks.train_steps(2)) == 2
    assert [r["step"] for r in chunks.train_steps()] == [3, 4]
    assert chunks.train_steps() == []  # spent: nothing more
    chunks.finish()

    flag = StopFlag()

    def stop_at_two(state: Any, record: dict[str, Any]) -> None:
        flag.requested = flag.requested or record["step"] == 1  # seen when window 2 ends

    first = trainer(tmp_path / "resumed", 17, stop=flag, on_step=stop_at_two)
    with pytest.raises(StopRequested):
        first.fit()
    assert len(first.state.records) == 2
    again = trainer(tmp_path / "resumed", 17)
    state = again.setup()
    assert state.source.next_step == 2
    again.fit()
    assert [r["step"] for r in state.records] == [1, 2, 3, 4]


def test_the_config_refuses_a_budget_below_one_and_with_an_outer_sync() -> None:
    with pytest.raises(ValueError, match=r"trainer.max_samples must be > 0, got 0"):
        from_mapping({"trainer": {"max_samples": 0}})
    with pytest.raises(ValueError, match=r"trainer.max_samples=64 cannot end an outer-synced run"):
        from_mapping({"trainer": {"max_samples": 64}, "outer": {"method": "local_sgd", "every": 2}})
    assert from_mapping({"trainer": {"max_samples": 64}}).trainer.max_samples == 64
