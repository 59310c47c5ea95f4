"""Jobs on a real local Slurm cluster (the ``slurm_cluster`` fixture from tests/slurm_fixtures.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distaccum.cluster.slurm import SlurmError, parse_nodelist, wait_job
from slurm_fixtures import REPO, SlurmCluster

pytestmark = pytest.mark.slurm
# Not `serial`: the cluster is this file's own (own ports and state directory), no test times the training,
# and the deadlines (a job that cannot start fails within 30 s; jobs within 60-180 s) hold with another
# test file running beside it. Run alone it cost the other pytest worker ~100 s of idling.


def _sbatch(cluster: SlurmCluster, tmp_path: Path, name: str, *lines: str) -> str:
    """Submit ``tmp_path/NAME.sbatch`` (``lines``, its output to ``tmp_path/NAME-JOBID.out``); the job id."""
    script = tmp_path / f"{name}.sbatch"
    script.write_text("\n".join(["#!/bin/bash", f"#SBATCH --output={tmp_path}/{name}-%j.out", *lines, ""]))
    return cluster.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]


def _distaccum(
    cluster: SlurmCluster, cwd: Path, *args: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """``python -m distaccum ARGS`` in ``cwd``, with the cluster's commands and configuration."""
    argv = [sys.executable, "-m", "distaccum", *args]
    return subprocess.run(argv, cwd=cwd, env=cluster.env, capture_output=True, text=True, timeout=timeout)


def _sacct_state(cluster: SlurmCluster, job_id: str, timeout_s: float = 20) -> str:
    """The job's state in accounting (slurmctld reports it to slurmdbd asynchronously)."""
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = cluster.run("sacct", "-X", "-n", "-P", "-o", "State", "-j", job_id, check=False).stdout
        state = out.strip()
        if state and state not in ("PENDING", "RUNNING", "COMPLETING"):
            return state
        time.sleep(0.5)
    return state


def test_two_task_job_runs(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    srun = """srun -n2 bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS"'"""
    job_id = _sbatch(slurm_cluster, tmp_path, "smoke", "#SBATCH --job-name=smoke", "#SBATCH --ntasks=2", srun)
    state = wait_job(job_id, timeout_s=60, env=slurm_cluster.env)
    out = (tmp_path / f"smoke-{job_id}.out").read_text()
    assert state == "COMPLETED", f"{state}\n{out}\n{slurm_cluster.logs()}"
    assert sorted(line for line in out.splitlines() if line.startswith("task")) == [
        "task 0 of 2",
        "task 1 of 2",
    ]
    assert _sacct_state(slurm_cluster, job_id) == "COMPLETED"


def test_failed_job_is_visible_to_sacct(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # submitit decides that a job without a result file is finished from sacct's state alone.
    job_id = _sbatch(slurm_cluster, tmp_path, "fail", "srun -n1 bash -c 'exit 3'")
    assert wait_job(job_id, timeout_s=60, env=slurm_cluster.env) == "FAILED"
    assert _sacct_state(slurm_cluster, job_id) == "FAILED"


@pytest.mark.parametrize("nodelist", ["node[01-03,07],gpu5", "n[8-11]", "r[1-2]-n[1,3]"])
def test_parse_nodelist_agrees_with_scontrol(slurm_cluster: SlurmCluster, nodelist: str) -> None:
    out = slurm_cluster.run("scontrol", "show", "hostnames", nodelist).stdout
    assert parse_nodelist(nodelist) == out.split()


def test_distaccum_submit_trains(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    submit = ("submit", "trainer.nproc=2", "model=mlp", "trainer.max_steps=3", f"run_dir={run_dir}")
    proc = _distaccum(slurm_cluster, REPO, *submit, "log.console=quiet", timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().splitlines()[-1]
    state = wait_job(job_id, timeout_s=240, pending_timeout_s=60, env=slurm_cluster.env)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run_dir.glob("slurm-*"))
    )
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{logs}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3, logs
    assert all("loss" in record for record in records)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and all(r["comm_rounds"] == 1 for r in records)


def test_submitit_sweep_over_splits_then_one_report(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """Hydra's submitit_slurm launcher runs each split as a Slurm job; one report compares them."""
    sweep = tmp_path / "sweep"
    launcher = "hydra/launcher=submitit_slurm"
    limits = ("hydra.launcher.timeout_min=10", "hydra.launcher.cpus_per_task=2")
    splits = ("model=mlp", "accum.micro_batch=2,4,8", "accum.global_batch=16", "trainer.max_steps=3")
    multirun = ("train", "--multirun", launcher, *limits, *splits, "log.console=quiet", f"run_dir={sweep}")
    proc = _distaccum(slurm_cluster, tmp_path, *multirun, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:] + slurm_cluster.logs()
    for job in ("0", "1", "2"):
        assert json.loads((sweep / job / "status.json").read_text())["status"] == "ok"
    report = subprocess.run(
        [sys.executable, "-m", "distaccum", "report", str(sweep)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stdout + report.stderr  # 0: every split's loss curve agrees
    table = (sweep / "report.md").read_text()
    for split in ("2x4x2=16", "4x2x2=16", "8x1x2=16"):
        assert split in table
    assert "3 runs: 3 ok" in table and (sweep / "report.png").stat().st_size > 10_000


def test_usr1_before_the_limit_checkpoints_requeues_and_resumes(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """What `--signal=B:USR1@N` does near a time limit: finish the window, checkpoint, requeue,
    resume at the exact next sample — no partial window lost, none repeated."""
    run_dir = tmp_path / "preempted"
    steps = 2000
    model = ("model=mlp", "model.width=16", "accum.micro_batch=2", "accum.steps=2")
    submit = ("submit", *model, f"trainer.max_steps={steps}", "trainer.check_every=0", "log.console=quiet")
    proc = _distaccum(slurm_cluster, REPO, *submit, f"run_dir={run_dir}", timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().splitlines()[-1]
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 5:
        queue = slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%T %r", check=False).stdout.strip()
        assert time.monotonic() < deadline and queue.startswith(("PENDING", "RUNNING", "CONFIGURING")), (
            f"job {job_id} never reached step 5 (squeue: {queue!r})\n{slurm_cluster.logs()}"
        )
        time.sleep(0.1)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)  # what the limit's warning sends
    # A requeued job waits ~120 s before it may start again; move its start time to now, but only once
    # it is PENDING, its previous allocation is released (the node idle again) and 2 s have passed:
    # slurmd refuses a credential created in the same second as the previous allocation's revocation
    # (its timestamps have 1 s resolution), and Slurm then kills the job ("Killing non-startable
    # batch job: Job credential revoked", seen 2 of 5 runs when the update came 0.2 s later).
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        state = slurm_cluster.run("squeue", "-h", "-j", job_id, "-o", "%T", check=False).stdout.strip()
        node = slurm_cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip()
        if state == "PENDING" and node == "idle":
            time.sleep(2.0)
            slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)
            break
        time.sleep(0.2)
    else:
        raise AssertionError(
            f"job {job_id} never came back to PENDING on an idle node\n{slurm_cluster.logs()}"
        )
    state = wait_job(job_id, timeout_s=300, pending_timeout_s=120, env=slurm_cluster.env)
    logs = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(run_dir.glob("slurm-*")))
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{logs}"
    assert "resumed from" in logs, logs
    done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert done == list(range(1, steps + 1))
    restarts = slurm_cluster.run("scontrol", "show", "job", job_id, check=False).stdout
    assert "Restarts=1" in restarts, restarts  # ran twice: before and after the requeue


def test_ft_groups_share_a_node_and_a_killed_group_restarts_and_heals(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    """`distaccum submit ... ft.groups=2` on a one-node cluster: the Lighthouse as a job step, two replica groups of
    one worker sharing the node, group 1 SIGKILLed in step 5's micro-batches; the job's loop starts its step again
    (its own run directory, g1-a1), it heals from group 0 and both end on the same parameters, every step trained
    and the job COMPLETED. Group 0 waits at its 40th micro-batch until the restarted group asks for its first quorum
    (``AwaitRejoin``), so the restart heals however slowly it starts."""
    import torch
    from safetensors.torch import load_file

    from conftest import fault, inject

    run_dir = tmp_path / "ft"
    run_dir.mkdir()
    faults = inject(
        "distaccum.losses.mse",
        fault("KillGroup", group=1, call=30),  # K = 6 per group: step 5's last micro-batch
        fault("AwaitRejoin", waiting=0, restarted=1, call=40, marker=str(tmp_path / "rejoined")),
    )
    submit = [
        "submit",
        "slurm.nodes=1",
        "trainer.nproc=2",  # the node's two workers: one per group
        "ft.groups=2",
        "ft.heartbeat_timeout_ms=500",
        "model=mlp",
        "accum.global_batch=24",
        "accum.micro_batch=2",
        "trainer.max_steps=30",
        "trainer.save_final=true",
        "log.console=quiet",
        f"run_dir={run_dir}",
        *faults,
    ]
    proc = _distaccum(slurm_cluster, REPO, *submit, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().splitlines()[-1]
    state = wait_job(job_id, timeout_s=240, pending_timeout_s=60, env=slurm_cluster.env)
    err = "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted(run_dir.glob("slurm-*")))
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{err}"
    assert "replica group 1 failed: restart 1" in err and "[INFO]" not in err  # RUST_LOG=warn in the job
    groups = run_dir / "groups"
    assert sorted(g.name for g in groups.iterdir()) == ["g0-a0", "g1-a0", "g1-a1"]

    def records(name: str) -> list[dict]:
        return [json.loads(line) for line in (groups / name / "metrics.jsonl").read_text().splitlines()]

    assert [r["step"] for r in records("g0-a0")] == list(range(1, 31))
    assert [r["ft_groups"] for r in records("g0-a0")][4] == [
        0
    ]  # step 5 computed again by group 0 alone: K = 12
    assert records("g0-a0")[4]["micro_steps"] == 12
    healed = [r["step"] for r in records("g1-a1") if r["ft_healed"]]
    assert healed and records("g1-a1")[-1]["step"] == 30, healed
    final = [load_file(str(groups / g / "final" / "model.safetensors")) for g in ("g0-a0", "g1-a1")]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_srun_tasks_run_as_ranks_in_place(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    """`srun -n 2 distaccum train`: each task is one rank (SLURM_PROCID/NTASKS), no launcher."""
    run_dir = tmp_path / "srun"
    srun = ("srun", "-n", "2", "--cpus-per-task=1", sys.executable, "-m", "distaccum")
    train = ("train", "model=mlp", "trainer.max_steps=3", "log.console=quiet", f"run_dir={run_dir}")
    proc = slurm_cluster.run(*srun, *train, check=False, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3


def test_a_job_that_does_not_start_fails_fast_with_the_reason(
    slurm_cluster: SlurmCluster, tmp_path: Path
) -> None:
    # Pending for a reason the test controls (a start time an hour away), instead of a real one
    # (not enough CPUs) that would depend on the machine.
    job_id = _sbatch(slurm_cluster, tmp_path, "later", "#SBATCH --begin=now+3600", "true")
    start = time.monotonic()
    with pytest.raises(SlurmError, match="still pending after .* reason 'BeginTime'"):
        wait_job(job_id, timeout_s=60, pending_timeout_s=2, env=slurm_cluster.env)
    assert time.monotonic() - start < 30
    slurm_cluster.run("scancel", job_id, check=False)
