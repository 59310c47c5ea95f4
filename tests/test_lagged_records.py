"""Lagged records (:class:`distaccum.loop.StepEnd`, the default on CUDA): the same training and the same records
as the synchronous loop, each handed over once the next step is queued, except the steps that must be exact at
once (an evaluation's, a checkpoint's, a call's last). On a one-rank gloo group: the lag does not depend on the
device; what it saves (no device drain per step) is ``tests/test_ledger_gpu.py``'s on a GPU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from distaccum import losses
from distaccum.datasets import SyntheticRegression
from distaccum.loop import TrainState
from distaccum.models import MLP
from distaccum.trainer import Trainer, records_lag

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("cpu_group")]  # conftest: one gloo rank

TIMINGS = {
    "time_s",
    "data_s",
    "compute_s",
    "optim_s",
    "last_micro_s",
    "comm_s",
    "comm_exposed_s",
    "peak_mem_bytes",
    "samples_per_s",
    "items_per_s",
    "compute_min_s",
    "compute_max_s",
}
STEPS, EVAL_EVERY, CHECKPOINT_EVERY = 9, 3, 4


def run(run_dir: Path, lag: bool) -> tuple[Trainer, list[tuple[int, int, float]]]:
    """Train in two calls (5 + 4 steps); ``on_step`` notes (record's step, steps the model has taken, a checksum
    of the parameters it sees)."""
    seen: list[tuple[int, int, float]] = []

    def on_step(state: TrainState, record: dict[str, Any]) -> None:
        total = sum(float(p.detach().double().sum()) for _, p in state.engine.full_parameters())
        seen.append((int(record["step"]), state.source.next_step, total))

    cfg = {
        "accum": {"micro_batch": 2, "steps": 3},
        "trainer": {
            "nproc": 1,
            "max_steps": STEPS,
            "check_every": 0,
            "save_final": False,
            "checkpoint_every": CHECKPOINT_EVERY,
        },
        "eval": {"every": EVAL_EVERY, "at_end": False},
        "log": {"console": "quiet", "rank_stats_every": 2},
        "run_dir": str(run_dir),
    }
    trainer = Trainer(
        cfg,
        model=lambda: MLP(32, 16, 2, 8),
        dataset=SyntheticRegression(70),
        loss=losses.mse,
        on_step=on_step,
        lag_records=lag,
        eval_dataset=SyntheticRegression(16, seed=7),
    )
    trainer.train_steps(5)
    trainer.train_steps()
    return trainer, seen


def same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def test_lagged_records_are_the_synchronous_ones_handed_over_a_step_later(tmp_path: Path) -> None:
    sync, sync_seen = run(tmp_path / "sync", lag=False)
    lagged, lagged_seen = run(tmp_path / "lagged", lag=True)
    for a, b in zip(sync.state.records, lagged.state.records, strict=True):  # every field but the timings
        assert a.keys() == b.keys() and all(same(a[k], b[k]) for k in a if k not in TIMINGS), (a, b)
    assert all(r["time_s"] > 0 for r in lagged.state.records)
    final = [
        torch.cat([p.detach().flatten() for _, p in t.state.engine.full_parameters()]) for t in (sync, lagged)
    ]
    assert torch.equal(*final)
    # metrics.jsonl holds every step once, in order, each evaluation after its step's line
    lines = [json.loads(line) for line in (tmp_path / "lagged" / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], "eval_loss" in line) for line in lines] == [
        pair
        for s in range(1, STEPS + 1)
        for pair in [(s, False)] + ([(s, True)] if s % EVAL_EVERY == 0 else [])
    ]
    # Synchronous: on_step sees the model right after its step. Lagged: one step further, except where the
    # record must be exact at once: evaluations (3, 6, 9), checkpoints (4, 8) and each call's last step (5, 9).
    exact = {3, 4, 5, 6, 8, 9}
    checksum = {step: total for step, _, total in sync_seen}
    assert [(s, n) for s, n, _ in sync_seen] == [(s, s) for s in range(1, STEPS + 1)]
    assert [(s, n) for s, n, _ in lagged_seen] == [
        (s, s if s in exact else s + 1) for s in range(1, STEPS + 1)
    ]
    for _, taken, total in lagged_seen:
        assert total == checksum[taken]
    # every evaluation saw the same model
    evals = [
        [
            (line["step"], line["eval_loss"])
            for line in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
            if "eval_loss" in line
        ]
        for name in ("sync", "lagged")
    ]
    assert evals[0] == evals[1] and len(evals[0]) == STEPS // EVAL_EVERY


def test_the_checkpoint_of_a_lagged_run_holds_its_step_s_record(tmp_path: Path) -> None:
    """A checkpoint step is handed over before the save: the resumed run continues the same records."""
    lagged, _ = run(tmp_path / "lagged", lag=True)
    resumed, _ = run(tmp_path / "lagged", lag=True)  # trainer.resume: from the step-8 checkpoint, then step 9
    assert [r["step"] for r in resumed.state.records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in resumed.state.records] == [r["loss"] for r in lagged.state.records]


def test_records_lag_by_default_on_cuda_only_without_an_on_step() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert (
        records_lag(cuda, False, None)
        and not records_lag(cpu, False, None)
        and not records_lag(cuda, True, None)
    )
    assert records_lag(cpu, True, True) and not records_lag(cuda, False, False)
