"""The reduction count (distaccum/guards/reduction_count.py): the micro-batches that reduced gradients each step, from
the engine's ledger, against what ``accum.sync`` promises; its warning, and the diagnosis verify gives it even when
the weights agree. The real injected bugs (no_sync around the backward, a DDP-only helper under FSDP2, nested DDP)
run in tests/test_bugzoo.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import engine_spec
from distaccum.config import EngineConfig
from distaccum.engines.fsdp import FSDPEngine
from distaccum.guards.reduction_count import CHECK, ReductionCount
from distaccum.rundir import WARNINGS, read_warnings
from distaccum.split import Split
from distaccum.telemetry.ledger import CommLedger
from distaccum.verify.compare import Divergence, Report
from distaccum.verify.diagnosis import CAUSES, RunFacts, StepFacts, diagnose

pytestmark = pytest.mark.unit

SPLIT = Split(2, 4, 2)


def promise(sync: str, replicas: int = 1) -> tuple[int, int] | None:
    """What FSDP2 on 4 ranks (2 replicas of 2 with ``replicas=2``) promises at K = 4."""
    spec = replace(engine_spec(EngineConfig(name="fsdp"), Split(2, 4, 4), sync=sync), replicas=replicas)
    return FSDPEngine(spec, CommLedger(enabled=False)).reduction_rounds()  # EngineBase's, by accum.sync


def test_each_sync_mode_promises_its_rounds() -> None:
    assert promise("boundary") == (1, 0)
    assert promise("every_micro") == (4, 0)
    assert promise("boundary", replicas=2) == (1, 1)  # HSDP: one reduce-scatter and one all-reduce
    assert promise("replica_boundary", replicas=2) == (4, 1)
    assert promise("every_micro", replicas=2) == (4, 4)
    # two replicas of one rank each: nothing to reduce-scatter inside a replica (measured: FSDP2 launches none)
    spec = replace(
        engine_spec(EngineConfig(name="fsdp"), Split(2, 4, 2), sync="replica_boundary"), replicas=2
    )
    assert FSDPEngine(spec, CommLedger(enabled=False)).reduction_rounds() == (0, 1)


def a_step(ledger: CommLedger, reducing: list[int], k: int = 4) -> None:
    """One step of K micro-batches in which the micro-batches ``reducing`` (1-based) launch two collectives each."""
    ledger.start_step()
    for micro in range(1, k + 1):
        ledger.start_micro()
        if micro in reducing:
            for _ in range(2):  # two buckets: still one round
                ledger.completed(ledger.launched(torch.zeros(3)))


def test_the_ledger_counts_micro_batches_that_reduced() -> None:
    ledger = CommLedger(enabled=False)
    a_step(ledger, [4])
    assert ledger.rounds() == (1, 0)
    a_step(ledger, [1, 2, 3, 4])
    assert ledger.rounds() == (4, 0) and ledger.end_step().comm_rounds == 4


def monitor(
    tmp_path: Path, promised: tuple[int, int] | None, world: int = 2
) -> tuple[ReductionCount, CommLedger]:
    ledger = CommLedger(enabled=False)
    engine = SimpleNamespace(
        ledger=ledger,
        reduction_rounds=lambda accum_steps=None: promised,
        spec=SimpleNamespace(sync="boundary"),
    )
    return ReductionCount(engine, tmp_path, rank=0, world_size=world), ledger


def test_the_first_step_with_extra_rounds_warns_once(tmp_path: Path) -> None:
    check, ledger = monitor(tmp_path, (1, 0))
    a_step(ledger, [4])
    check.after_step(1, None, 1.0, 1.0)
    assert not (tmp_path / WARNINGS).exists()  # the promise kept: silent
    for step in (2, 3):
        a_step(ledger, [1, 2, 3, 4])
        check.after_step(step, None, 1.0, 1.0)
    [warning] = read_warnings(tmp_path)
    assert (warning["check"], warning["step"]) == (CHECK, 2)
    assert (
        "4 of the window's micro-batches reduced gradients, accum.sync=boundary promises 1"
        in warning["message"]
    )


def test_a_missing_round_warns_too(tmp_path: Path) -> None:
    check, ledger = monitor(tmp_path, (1, 0))
    a_step(ledger, [])
    check.after_step(1, None, 1.0, 1.0)
    [warning] = read_warnings(tmp_path)
    assert "0 of the window's micro-batches" in warning["message"] and "did not run" in warning["message"]


@pytest.mark.parametrize(("promised", "world"), [(None, 2), ((1, 0), 1)])
def test_no_promise_or_one_rank_checks_nothing(
    tmp_path: Path, promised: tuple[int, int] | None, world: int
) -> None:
    check, ledger = monitor(tmp_path, promised, world)
    a_step(ledger, [1, 2, 3, 4])
    check.after_step(1, None, 1.0, 1.0)
    assert not (tmp_path / WARNINGS).exists()


def test_verify_diagnoses_the_count_even_when_the_weights_agree() -> None:
    assert "reduction_count" in CAUSES
    passed = Report(True, 3, 0.0, 0.0, None, 0.0, 0.0, None)
    warned = StepFacts(warnings=((CHECK, "optimizer step 1: 4 of ..."),))
    [finding] = diagnose(passed, RunFacts(), SPLIT, None, steps=warned)
    assert finding.cause == "reduction_count"
    assert diagnose(passed, RunFacts(), SPLIT, None, steps=StepFacts()) == []
    # a failing run that warned is diagnosed as the count first (the wrong gradient follows from it)
    failed = replace(passed, passed=False, first_divergence=Divergence(1, "grad_norm", None))
    assert [f.cause for f in diagnose(failed, RunFacts(), SPLIT, None, steps=warned)][0] == "reduction_count"


def test_the_warning_record_is_one_json_line(tmp_path: Path) -> None:
    check, ledger = monitor(tmp_path, (1, 0))
    a_step(ledger, [1, 4])
    check.after_step(5, None, 1.0, 1.0)
    line = (tmp_path / WARNINGS).read_text().splitlines()
    assert len(line) == 1 and json.loads(line[0])["step"] == 5


def test_the_promise_follows_each_steps_k_under_a_batch_schedule(tmp_path: Path) -> None:
    """every_micro promises K rounds: a ramp's steps of K = 1, 2 and 4 each keep it (the ledger counts the step's
    micro-batches); a step of K = 4 with 3 rounds does not."""
    ledger = CommLedger(enabled=False)
    engine = SimpleNamespace(
        ledger=ledger,
        reduction_rounds=lambda accum_steps=None: (accum_steps or 4, 0),
        spec=SimpleNamespace(sync="every_micro"),
    )
    check = ReductionCount(engine, tmp_path, rank=0, world_size=2)
    for step, k in enumerate((1, 2, 4), start=1):
        a_step(ledger, list(range(1, k + 1)), k=k)
        assert ledger.micro_batches() == k
        check.after_step(step, None, 1.0, 1.0)
    assert not (tmp_path / WARNINGS).exists()
    a_step(ledger, [1, 2, 3], k=4)
    check.after_step(4, None, 1.0, 1.0)
    assert "optimizer step 4: 3 of the window's micro-batches" in (tmp_path / WARNINGS).read_text()
