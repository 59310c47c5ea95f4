"""The growing global batch on real workers (gloo, 2 ranks): a ramp verified against the single-process
reference across two change points on DDP and FSDP2 in fp64; kill -9 and restart across a change (ramp) and across
adaptive decisions, bit-identical to an uninterrupted run; a resume on another world keeping the ramp's global
batches; the adaptive batch's ranks agreeing at every decision, and a rank that does not stopping the run."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from test_faults import LOSS, rank_pid, run, start, steps, summary, wait_for_step

from conftest import fault, inject, run_cli

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

RAMP = ("accum.micro_batch=2", "accum.global_batch=16", "accum.ramp.points=[[1,4],[3,8],[6,16]]")
"""Global batch 4 (K=1, the micro-batch 2 x 2 ranks) for steps 1-2, 8 (K=2) for 3-5, 16 (K=4) from 6 on."""


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_ramped_run_matches_the_reference_taking_each_steps_global_batch_at_once(
    tmp_path: Path, engine: str
) -> None:
    run_dir = tmp_path / "verify"
    done = run_cli(
        "verify", run_dir, "model=mlp", f"engine={engine}", "precision=fp64", "trainer.max_steps=8", *RAMP
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads((run_dir / "verify.json").read_text())["candidates"]
    assert row["passed"] and row["steps_compared"] == 8 and row["max_rel_diff"] < 1e-12, row  # fp64: rounding
    candidate = records(run_dir / "w2-m2-k4")
    reference = records(run_dir / "reference")
    assert [r["global_batch"] for r in candidate] == [4, 4, 8, 8, 8, 16, 16, 16]
    assert [r["samples"] for r in reference] == [4, 4, 8, 8, 8, 16, 16, 16]  # one forward/backward each
    assert [r["micro_steps"] for r in candidate] == [1, 1, 2, 2, 2, 4, 4, 4]
    assert all(r["comm_bytes_per_sample"] == r["comm_bytes"] / r["samples"] for r in candidate)
    assert (
        len({r["comm_bytes"] for r in candidate}) == 1
    )  # one reduction per step whatever K: bytes/sample fall


SCHEDULES = {
    # changes before steps 5 and 9; checkpoints every 3: a kill after step 7 resumes from 6 and redoes the change at 9
    "ramp": ("accum.global_batch=16", "accum.ramp.points=[[1,4],[5,8],[9,16]]"),
    # decisions after steps 4 and 8: the restart from step 6 reads the phase chosen at 4 from the checkpoint and the
    # estimate's averages from the records, and must decide at 8 as the uninterrupted run did
    "adaptive": (
        "accum.global_batch=8",
        "log.gns=true",
        "accum.adaptive.enabled=true",
        "accum.adaptive.every=4",
        "accum.adaptive.warmup=4",
    ),
}
N = 12


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_kill_9_and_restart_across_a_change_is_bit_identical(tmp_path: Path, schedule: str) -> None:
    overrides = (
        *SCHEDULES[schedule],
        "precision=fp64",
        f"trainer.max_steps={N}",
        "trainer.checkpoint_every=3",
    )
    straight = tmp_path / "straight"
    done = run(straight, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "killed"
    proc = start(run_dir, *overrides, "trainer.max_restarts=1", "trainer.shutdown_grace_s=5")
    victim = rank_pid(run_dir, 1)
    wait_for_step(run_dir, 7, proc)
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert steps(run_dir) == list(range(1, N + 1))  # none lost, none twice
    assert "distaccum: elastic restart 1: rank 1 (pid" in err and "died without a trace" in err
    assert "distaccum: resumed from" in out and "/checkpoints/step-000000" in out
    resumed = int(out.split("after optimizer step ")[1].split()[0].rstrip(":,.;"))
    theirs, ours = records(straight), records(run_dir)
    batches = [r["global_batch"] for r in ours]
    assert batches == [r["global_batch"] for r in theirs]
    assert any(batches[i] != batches[i - 1] for i in range(resumed, N)), "no change after the resumed step"
    if schedule == "adaptive":
        decided = [
            (r["step"], r["adaptive_noise_scale"], r["adaptive_next_batch"])
            for r in ours
            if "adaptive_next_batch" in r
        ]
        assert [d[0] for d in decided] == [4, 8]
        assert decided == [
            (r["step"], r["adaptive_noise_scale"], r["adaptive_next_batch"])
            for r in theirs
            if "adaptive_next_batch" in r
        ]
        assert len(set(batches)) > 1, "the adaptive rule never changed the batch"
    assert [r["loss"] for r in ours] == [r["loss"] for r in theirs]
    for key in ("param_sum", "param_l2", "batch_phases"):
        assert summary(run_dir)[key] == summary(straight)[key]  # bit for bit


def test_a_resume_on_another_world_keeps_the_ramps_global_batches(tmp_path: Path) -> None:
    """Also the plain case's test (a world-2 run resumed on world 1 ends where an uninterrupted world-2 run does):
    the same launches, with the ramp's K re-derived per phase on the new world."""
    common = ("precision=fp64", "trainer.checkpoint_every=4", *SCHEDULES["ramp"])
    straight = tmp_path / "straight"
    assert run(straight, *common, "trainer.nproc=2", "trainer.max_steps=12").returncode == 0
    moved = (
        tmp_path / "moved"
    )  # issue 58.5: ended by its budget, 4 steps of 4 samples (the bound is 12 steps)
    first = run(moved, *common, "trainer.nproc=2", "trainer.max_steps=12", "trainer.max_samples=15")
    assert first.returncode == 0 and steps(moved) == [1, 2, 3, 4], first.stderr[-3000:]
    second = run(moved, *common, "trainer.nproc=1", "trainer.max_steps=12")  # K doubles on one rank
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {moved}/checkpoints/step-00000004 after optimizer step 4" in second.stdout
    assert steps(moved) == list(range(1, 13)) and summary(moved)["accum_steps"] == 8
    ours, theirs = records(moved), records(straight)
    assert (
        [r["global_batch"] for r in ours]
        == [r["global_batch"] for r in theirs]
        == [4] * 4 + [8] * 4 + [16] * 4
    )
    assert [r["micro_steps"] for r in ours] == [1] * 4 + [4] * 4 + [8] * 4  # world 2, then 1
    for key in ("param_sum", "param_l2"):
        assert summary(moved)[key] == pytest.approx(summary(straight)[key], rel=1e-12)


def test_adaptive_ranks_that_disagree_stop_the_run_naming_them(tmp_path: Path) -> None:
    """Rank 1's smoothed estimate read one unit in the last place high (a fault wrapping its noise-scale monitor):
    the decision's all-gather sees different bits and the run stops at the first decision."""
    done = run(
        tmp_path / "skewed",
        *SCHEDULES["adaptive"],
        "trainer.max_steps=6",
        *inject(LOSS, fault("SkewedNoiseScale", rank=1)),
    )
    assert done.returncode == 1
    assert "accum.adaptive after step 4: rank(s) 1 computed another global batch than rank 0" in done.stderr
    assert steps(tmp_path / "skewed")[-1] <= 4


@pytest.mark.dist
def test_a_ramp_cut_short_by_max_steps_states_the_batch_it_ran(tmp_path: Path) -> None:
    """Issue 56.3: a Megatron-form ramp (8, +8 every 40 samples, to 32) whose 10 steps end at 24 printed `split
    2x8x2=32` and wrote global_batch 32 and a phase after the last step to summary.json. Now the first line says
    the batch ramps, the start warns that the ramp ends early, and the done line and summary.json state the batch
    of the last step, from its record, with the phases the steps reached."""
    megatron = ("accum.ramp.start=8", "accum.ramp.increment=8", "accum.ramp.samples=120")
    done = run_cli(
        "train",
        tmp_path / "ramp",
        "model=mlp",
        "accum.micro_batch=2",
        "accum.global_batch=32",
        *megatron,
        "trainer.max_steps=10",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    last = records(tmp_path / "ramp")[-1]
    summary = json.loads((tmp_path / "ramp" / "summary.json").read_text())
    assert (
        (summary["global_batch"], summary["accum_steps"], summary["micro_batch"])
        == (24, 6, 2)
        == (last["global_batch"], last["micro_steps"], 2)
    )
    assert [batch for _, batch in summary["batch_phases"]] == [8, 16, 24]
    assert "a global batch ramping 8 -> 32 (accum.ramp)" in done.stdout
    assert (
        "the ramp does not reach its end within trainer.max_steps=10: the run ends at a global batch of 24"
        in (done.stdout)
    )
    assert "split 2x6x2=24 (global batch 8 -> 16 -> 24)" in done.stdout
