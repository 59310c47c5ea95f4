"""Jobs on a real local Slurm cluster (the ``slurm_cluster`` fixture from tests/slurm_fixtures.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_fixtures import REPO, SlurmCluster

from distaccum.slurm import parse_nodelist, wait_job

pytestmark = pytest.mark.slurm


def _sbatch(cluster: SlurmCluster, script: Path, body: str) -> str:
    script.write_text("#!/bin/bash\n" + body)
    return cluster.run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]


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
    job_id = _sbatch(slurm_cluster, tmp_path / "smoke.sbatch", f"""\
#SBATCH --job-name=smoke
#SBATCH --ntasks=2
#SBATCH --output={tmp_path}/smoke-%j.out
srun -n2 bash -c 'echo "task $SLURM_PROCID of $SLURM_NTASKS"'
""")
    state = wait_job(job_id, timeout_s=60, env=slurm_cluster.env)
    out = (tmp_path / f"smoke-{job_id}.out").read_text()
    assert state == "COMPLETED", f"{state}\n{out}\n{slurm_cluster.logs()}"
    assert sorted(line for line in out.splitlines() if line.startswith("task")) == ["task 0 of 2", "task 1 of 2"]
    assert _sacct_state(slurm_cluster, job_id) == "COMPLETED"


def test_failed_job_is_visible_to_sacct(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # submitit decides that a job without a result file is finished from sacct's state alone.
    job_id = _sbatch(slurm_cluster, tmp_path / "fail.sbatch", f"""\
#SBATCH --output={tmp_path}/fail-%j.out
srun -n1 bash -c 'exit 3'
""")
    assert wait_job(job_id, timeout_s=60, env=slurm_cluster.env) == "FAILED"
    assert _sacct_state(slurm_cluster, job_id) == "FAILED"


@pytest.mark.parametrize("nodelist", ["node[01-03,07],gpu5", "n[8-11]", "r[1-2]-n[1,3]"])
def test_parse_nodelist_agrees_with_scontrol(slurm_cluster: SlurmCluster, nodelist: str) -> None:
    out = slurm_cluster.run("scontrol", "show", "hostnames", nodelist).stdout
    assert parse_nodelist(nodelist) == out.split()


def test_distaccum_submit_trains(slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    # distaccum.cli dispatches `submit` to distaccum.submit_cli, which calls distaccum.slurm.submit.
    if importlib.util.find_spec("distaccum.submit_cli") is None:
        pytest.skip("the `distaccum submit` command (distaccum/submit_cli.py) does not exist yet")
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "distaccum", "submit", "trainer.nproc=2", "model=mlp", "trainer.max_steps=3",
         f"run_dir={run_dir}", "log.console=quiet"],
        cwd=REPO, env=slurm_cluster.env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.strip().splitlines()[-1]
    state = wait_job(job_id, timeout_s=240, env=slurm_cluster.env)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(run_dir.glob("slurm-*")))
    assert state == "COMPLETED", f"job {job_id} ended {state}\n{logs}"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3, logs
    assert all("loss" in record for record in records)
