"""The faults tier: real worker processes killed, stopped or poisoned on purpose, and what the user sees.

- SIGKILL of one rank mid-run with ``trainer.max_restarts=1``: torch elastic restarts the group, it
  resumes from the last periodic checkpoint, every step is in metrics.jsonl exactly once, and the final
  parameters are bit-identical to an uninterrupted run (DDP, FSDP2 via DCP, DeepSpeed ZeRO-2, DiLoCo islands).
- A world-2 run resumed on world 1 at the same global batch ends where an uninterrupted world-2 run does
  (tests/test_batch_growth_dist.py, with a ramped global batch).
- A SIGSTOPped rank ends the run within ``collective_timeout_s`` (+ the launcher's grace), named.
- A NaN on one rank is skipped by every rank; persistent NaN stops the run with a diagnosis.
- Incompatible or corrupt checkpoints: exit 2 before any worker starts, naming fields or paths.
- A checkpoint write that fails leaves the previous checkpoint intact and stops the run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import cli_server
import pytest

from conftest import EXTENSIONS, distaccum_cli, fault, inject, train

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

BASE = (
    *"model=mlp model.width=128 accum.micro_batch=2 accum.global_batch=16 trainer.check_every=0".split(),
    *"log.console=quiet optim.schedule=constant".split(),
    f"engine.extensions_dir={EXTENSIONS}",
)


LOSS = "distaccum.losses.mse"  # model=mlp's loss


def nan_loss(**kwargs: int) -> list[str]:
    """Overrides making the loss NaN on a rank at some steps (distaccum.testing.faults.NanLoss)."""
    return inject(LOSS, fault("NanLoss", **kwargs))


def command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "distaccum", "train", *BASE, *overrides, f"run_dir={run_dir}"]


def env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def run(run_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return distaccum_cli(command(run_dir, *overrides)[3:], cwd=run_dir.parent, env=env(), timeout=timeout)


def start(run_dir: Path, *overrides: str) -> cli_server.Started:
    """:func:`run` in the background, its output captured: for a test that signals its ranks."""
    return cli_server.popen(
        command(run_dir, *overrides)[3:],
        cwd=run_dir.parent,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def rank_pid(run_dir: Path, rank: int, timeout: float = 120) -> int:
    path = run_dir / "ranks" / f"rank-{rank:05d}.json"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file():
            return int(json.loads(path.read_text())["pid"])
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def wait_for_step(run_dir: Path, step: int, proc: cli_server.Started, timeout: float = 180) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"the run never reached step {step} (exit {proc.poll()})")


ENGINES = {
    # DDP's own kill: tests/test_batch_growth_dist.py::test_kill_9_and_restart_across_a_change_is_bit_identical
    # (the same launches and assertions, a DDP run whose global batch also ramps across the restart).
    "fsdp": ("engine=fsdp",),
    "zero2": ("engine=deepspeed", "engine.zero_stage=2"),
    # Outer-synced (issue 47): 2 islands of 1 rank, 2 fragments; the kill lands between two fragments' syncs, so
    # the checkpoint must hold the global parameters, the outer momentum and each island's unsynced item counts.
    "diloco": ("engine=ddp", "outer.method=diloco", "outer.every=4", "outer.fragments=2", "outer.islands=2"),
}
N = 36  # 9 checkpoints; the kill lands at one of them (N // 3), two thirds of the run still to go


@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_killed_rank_restarts_the_group_from_the_last_checkpoint(tmp_path: Path, engine: str) -> None:
    overrides = (*ENGINES[engine], f"trainer.max_steps={N}", f"trainer.checkpoint_every={N // 9}")
    straight = tmp_path / "straight"
    assert run(straight, *overrides).returncode == 0

    run_dir = tmp_path / "killed"
    proc = start(run_dir, *overrides, "trainer.max_restarts=1", "trainer.shutdown_grace_s=5")
    victim = rank_pid(run_dir, 1)
    wait_for_step(run_dir, N // 3, proc)
    os.kill(victim, signal.SIGKILL)  # mid-window: the next window is already under way
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert steps(run_dir) == list(range(1, N + 1))  # none lost, none twice
    assert "distaccum: elastic restart 1: rank 1 (pid" in err and "died without a trace" in err
    assert "distaccum: resumed from" in out and "/checkpoints/step-000000" in out
    for key in ("param_sum", "param_l2"):
        assert summary(run_dir)[key] == summary(straight)[key]  # bit for bit


@pytest.mark.serial  # asserts how long the run takes to end
def test_a_stopped_rank_fails_the_run_in_time_and_is_named(tmp_path: Path) -> None:
    run_dir = tmp_path / "stopped"
    proc = start(run_dir, "trainer.max_steps=100000", "trainer.collective_timeout_s=10")
    victim = rank_pid(run_dir, 1)
    wait_for_step(run_dir, 5, proc)
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.monotonic()
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - stopped_at
    assert proc.returncode == 1
    assert took < 10 + 30, f"the run took {took:.0f} s to end after SIGSTOP"
    assert f"rank 1 (pid {victim}) is stopped (SIGSTOP" in err, err[-3000:]
    assert "a collective waited trainer.collective_timeout_s=10 s and timed out" in err, err[-3000:]


def test_nan_on_one_rank_is_skipped_everywhere_and_persistent_nan_stops(tmp_path: Path) -> None:
    once = tmp_path / "once"
    proc = run(once, "trainer.max_steps=6", "trainer.check_every=1", *nan_loss(step=3, rank=1))
    assert proc.returncode == 0, proc.stderr[-3000:]  # the tripwire checked every step: ranks stayed equal
    records = [json.loads(line) for line in (once / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped"] for r in records] == [False, False, True, False, False, False]
    assert records[2]["nonfinite"] and records[2]["lr"] == records[3]["lr"]

    always = tmp_path / "always"
    proc = run(
        always, "trainer.max_steps=20", *nan_loss(step=4, steps=10, rank=1), "trainer.max_nonfinite_steps=3"
    )
    assert proc.returncode == 1
    assert "3 consecutive optimizer steps (up to step 6)" in proc.stderr
    assert "the loss was non-finite on rank(s) 1" in proc.stderr
    assert steps(always) == [1, 2, 3, 4, 5, 6]


def test_incompatible_and_corrupt_checkpoints_exit_2_before_workers_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run(run_dir, "trainer.max_steps=4", "trainer.checkpoint_every=2").returncode == 0
    changed = run(run_dir, "trainer.max_steps=8", "model.width=64")
    assert changed.returncode == 2 and "model:" in changed.stderr and "trainer.resume=false" in changed.stderr
    assert "equivalent to `" not in changed.stdout and "Traceback" not in changed.stderr
    batch = run(run_dir, "trainer.max_steps=8", "accum.global_batch=32")
    assert batch.returncode == 2 and "global_batch: 16 in the checkpoint, 32 now" in batch.stderr

    latest = run_dir / "checkpoints" / "step-00000004"
    (latest / "trainer_state.json").write_text("{}")
    fallback = run(run_dir, "trainer.max_steps=6")
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "skipped unusable checkpoint" in fallback.stderr
    assert f"resumed from {run_dir}/checkpoints/step-00000002 after optimizer step 2" in fallback.stdout

    for path in (run_dir / "checkpoints").iterdir():
        shutil.rmtree(path / "model")
    broken = run(run_dir, "trainer.max_steps=8")
    assert broken.returncode == 2 and "none is valid" in broken.stderr and "is missing" in broken.stderr


def test_a_longer_cosine_run_is_refused_until_told_how_to_continue_its_schedule(tmp_path: Path) -> None:
    """The trap: max_steps 6 -> 12 under the default cosine schedule used to resume silently, re-stretching the
    schedule so the learning rate climbed back up. Now: exit 2 before any worker starts, then `keep` as chosen."""
    run_dir = tmp_path / "R"
    first = [
        r["lr"]
        for r in train(run_dir, "model=mlp", "trainer.max_steps=6", "trainer.checkpoint_every=3").records
    ]
    longer = train(run_dir, "model=mlp", "trainer.max_steps=12", check=False)
    assert longer.returncode == 2 and "equivalent to `" not in longer.stdout, longer.stderr[-3000:]
    assert (
        "trainer.max_steps changed (6 in the checkpoint, 12 now) under the cosine schedule" in longer.stderr
    )
    assert "trainer.schedule_on_resume=keep" in longer.stderr and "Traceback" not in longer.stderr
    assert len(longer.records) == 6  # nothing ran
    kept = train(run_dir, "model=mlp", "trainer.max_steps=12", "trainer.schedule_on_resume=keep")
    assert "explicit trainer.max_steps: 6 -> 12" in kept.stdout and "schedule_on_resume=keep)" in kept.stdout
    lrs = [r["lr"] for r in kept.records]
    assert lrs[:6] == first and lrs[6:] == [first[5]] * 6  # at its final value


def test_a_failed_checkpoint_write_stops_the_run_and_keeps_the_previous_one(tmp_path: Path) -> None:
    run_dir = tmp_path / "full"
    proc = run(
        run_dir,
        "trainer.max_steps=30",
        "trainer.checkpoint_every=10",
        *inject(LOSS, fault("FullDisk", step=20)),
    )
    assert proc.returncode == 1
    assert (
        "writing the checkpoint after step 20 failed" in proc.stderr
        and "No space left on device" in proc.stderr
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-00000010"]
    # The same loss node (a resume must not change it); it stops before step 20's checkpoint.
    resumed = run(run_dir, "trainer.max_steps=15", *inject(LOSS, fault("FullDisk", step=20)))
    assert resumed.returncode == 0 and "after optimizer step 10" in resumed.stdout, resumed.stderr[-3000:]


def test_an_outer_synced_checkpoint_refuses_another_island_count(tmp_path: Path) -> None:
    """Each island's inner state and every rank's outer state are per rank: a resume on another world (and so
    another island count) is refused before any worker starts, naming both settings."""
    run_dir = tmp_path / "islands"
    outer = ("outer.method=diloco", "outer.every=2", "trainer.max_steps=4", "trainer.checkpoint_every=2")
    assert run(run_dir, *outer).returncode == 0
    again = run(run_dir, *outer, "trainer.max_steps=6", "trainer.nproc=1", "outer.islands=1")
    assert again.returncode == 2, again.stderr[-3000:]
    message = again.stdout + again.stderr
    assert "world_size" in message and "outer.islands" in message and "islands" in message


def test_a_checkpoint_written_under_the_old_island_names_resumes(tmp_path: Path) -> None:
    """Issue 57: a run written before an outer sync's groups were called islands keeps each island's state in
    ``replica-N`` and records ``outer.replicas``. Written here with today's names and turned back into the old ones
    (the folders, the manifest's file list and run identity, the identity's old name, config.json), it
    resumes with the old key, which says once what to write instead."""
    run_dir = tmp_path / "old-names"
    outer = ("outer.method=diloco", "outer.every=2", "trainer.checkpoint_every=2")
    assert run(run_dir, *outer, "outer.islands=2", "trainer.max_steps=4").returncode == 0
    for ckpt in (run_dir / "checkpoints").glob("step-*"):
        islands = sorted((ckpt / "model").glob("island-*"))
        assert [p.name for p in islands] == ["island-0", "island-1"]
        for folder in islands:
            folder.rename(folder.with_name(folder.name.replace("island-", "replica-")))
        manifest = json.loads((ckpt / "manifest.json").read_text())
        manifest["files"] = {k.replace("island-", "replica-"): v for k, v in manifest["files"].items()}
        manifest["fingerprint"] = manifest.pop("identity")  # its name before issue 57
        manifest["fingerprint"]["outer.replicas"] = manifest["fingerprint"].pop("outer.islands")
        (ckpt / "manifest.json").write_text(json.dumps(manifest))
    config = json.loads((run_dir / "config.json").read_text())
    config["outer"]["replicas"] = config["outer"].pop("islands")
    (run_dir / "config.json").write_text(json.dumps(config))

    resumed = run(run_dir, *outer, "outer.replicas=2", "trainer.max_steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "after optimizer step 4" in resumed.stdout
    # outer.replicas in the checkpoint's record and outer.replicas=2 now both read as outer.islands=2: unchanged
    assert "distaccum: 1 setting(s) changed since the checkpoint after optimizer step 4" in resumed.stdout
    assert "allowed  trainer.max_steps: 4 -> 6" in resumed.stdout
    said = "distaccum: outer.replicas is now outer.islands: write outer.islands=2"
    assert resumed.stderr.count(said) == 1, resumed.stderr[-3000:]
    assert steps(run_dir) == list(range(1, 7))
