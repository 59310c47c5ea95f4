"""The comm/compute ledger on real 2-rank gloo runs: exact counts and bytes, and timing relations.

Two runs of a communication-heavy MLP (3.19M parameters = 12.76 MB of fp32 gradients per round)
with K=4 micro-batches: ``boundary`` (one reduction round per optimizer step) and ``every_micro``
(K rounds). ``engine.bucket_cap_mb=1`` makes DDP use several buckets, so some communication is
hidden behind the backward. Timing assertions are structural (hold on any machine) or compare
medians of runs that differ by 4x in bytes, so they stay stable on a loaded 2-core box.
"""

from __future__ import annotations

from pathlib import Path
from statistics import median

import pytest

from conftest import Run, train
from distaccum.models import MLP

pytestmark = [pytest.mark.dist, pytest.mark.serial]  # compares communication times between two runs

K, STEPS, WIDTH, DEPTH = 4, 6, 1024, 4
COMMON = (
    "model=mlp",
    f"model.width={WIDTH}",
    f"model.depth={DEPTH}",
    "accum.micro_batch=2",
    f"accum.steps={K}",
    "engine.bucket_cap_mb=1",
    f"trainer.max_steps={STEPS}",
    "trainer.nproc=2",
    "log.rank_stats_every=1",
)


def param_count() -> int:
    return sum(p.numel() for p in MLP(width=WIDTH, depth=DEPTH).parameters())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    base: Path = tmp_path_factory.mktemp("ledger")
    return {sync: train(base / sync, *COMMON, f"accum.sync={sync}") for sync in ("boundary", "every_micro")}


@pytest.mark.parametrize("sync, rounds", [("boundary", 1), ("every_micro", K)])
def test_rounds_and_bytes_match_the_sync_mode(runs: dict[str, Run], sync: str, rounds: int) -> None:
    records = runs[sync].records
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # per optimizer step, not per micro
    one_copy = 4 * param_count()  # fp32 gradients, reduced once per round
    for r in records:
        assert r["micro_steps"] == K
        assert r["comm_rounds"] == rounds
        assert r["comm_bytes"] == rounds * one_copy
        assert r["comm_calls"] >= rounds


def test_every_micro_launches_k_times_the_collectives(runs: dict[str, Run]) -> None:
    # From step 2 on, DDP uses its rebuilt bucket layout in both runs (step 1 may differ).
    boundary, every = runs["boundary"].records[1:], runs["every_micro"].records[1:]
    per_round = boundary[0]["comm_calls"]
    assert per_round > 1, "bucket_cap_mb=1 should split the gradients into several buckets"
    assert all(r["comm_calls"] == per_round for r in boundary)
    assert all(r["comm_calls"] == K * per_round for r in every)


@pytest.mark.parametrize("sync", ["boundary", "every_micro"])
def test_times_are_consistent(runs: dict[str, Run], sync: str) -> None:
    for r in runs[sync].records:
        assert r["comm_s"] > 0
        assert 0 < r["comm_exposed_s"] <= r["comm_s"] + 1e-9
        if r["comm_calls"] > r["comm_rounds"]:  # several buckets per round: earlier ones overlap
            assert r["comm_exposed_s"] < r["comm_s"]
        # compute is what forward+backward took beyond the exposed communication: it must be
        # positive, i.e. the exposed tail never exceeds the forward+backward time it sits in.
        forward_backward = r["time_s"] - r["data_s"] - r["optim_s"]
        assert r["compute_s"] > 0 and r["comm_exposed_s"] < forward_backward
        if "compute_min_s" in r:  # the straggler view, every log.rank_stats_every steps
            assert r["compute_min_s"] <= r["compute_s"] <= r["compute_max_s"]  # rank 0 within the spread
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["time_s"])
        assert r["items_per_s"] == pytest.approx(r["items"] / r["time_s"])
        assert r["peak_mem_bytes"] > 4 * param_count()


def test_every_micro_communicates_longer_than_boundary(runs: dict[str, Run]) -> None:
    def med(sync: str, key: str) -> float:
        return median(r[key] for r in runs[sync].records[1:])

    assert med("every_micro", "comm_s") > med("boundary", "comm_s")
    assert med("every_micro", "comm_exposed_s") > med("boundary", "comm_exposed_s")


def test_summary_carries_the_medians(runs: dict[str, Run]) -> None:
    summary = runs["every_micro"].summary
    steady = runs["every_micro"].records[1:]  # log.warmup_steps=1
    assert summary["median_comm_bytes"] == K * 4 * param_count()
    assert summary["median_comm_rounds"] == K
    assert summary["median_comm_s"] == pytest.approx(median(r["comm_s"] for r in steady))
    assert 0 < summary["comm_share"] < 1
