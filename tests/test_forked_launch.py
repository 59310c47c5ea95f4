"""Workers forked from a server that loaded their libraries once (distaccum/cluster/forked.py).

A forked worker imports nothing heavy itself: ``PYTHONPROFILEIMPORTTIME`` shows torch imported once per process
that starts a fresh interpreter, which tells the launcher alone (1: its worker server is a fork of it, however many
workers and launches) from a server started as a new interpreter (2) and from spawned workers (the launcher and one
per worker per launch). What the server cannot inherit from
the launcher at launch time, the environment and the standard output, is passed to each worker.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distaccum.cluster import forked


@pytest.mark.unit
def test_a_forked_worker_gets_the_launchers_environment_and_its_ranks_variables() -> None:
    server = {"PATH": "/bin", "OMP_NUM_THREADS": "2", "STALE": "1"}  # the launcher's when the server started
    launch = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}  # the launcher's now
    found = {**server, "RANK": "1", "OMP_NUM_THREADS": "1", "MASTER_PORT": "29500"}  # torch elastic's on top
    assert forked.worker_env(found, launch, server) == {
        "PATH": "/bin",
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "RANK": "1",
        "MASTER_PORT": "29500",
    }  # STALE, which the launcher no longer has, is gone
    assert forked.available()  # Linux


@pytest.mark.dist
def test_verify_forks_every_candidates_workers_from_one_server(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "distaccum",
            "verify",
            "model=mlp",
            "trainer.max_steps=2",
            "verify.splits=auto",
            "verify.max_candidates=2",
            "log.console=quiet",
            f"run_dir={tmp_path / 'verify'}",
        ],
        cwd=tmp_path,
        env={**env, "PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    candidates = json.loads((tmp_path / "verify" / "verify.json").read_text())["candidates"]
    assert len(candidates) == 2  # two launches of 2 workers each ...
    fresh = re.findall(r"^import time:\s+\d+ \|\s+\d+ \|\s+torch$", proc.stderr, re.MULTILINE)
    assert (
        len(fresh) == 1
    )  # ... and torch imported by verify's process only: the server and the workers are forks


@pytest.mark.unit
def test_a_fork_takes_its_threads_from_omp_num_threads_as_a_new_interpreter_does() -> None:
    """The OpenMP runtime reads OMP_NUM_THREADS when torch loads: a worker forked from a server that imported torch
    kept the server's count (2 ranks on 2 cores ran 2 threads each) until the fork applied the launch's value."""
    import torch

    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        os.close(read)
        inherited = torch.get_num_threads()
        os.environ["OMP_NUM_THREADS"] = str(want)
        forked.apply_thread_env()
        os.write(write, f"{inherited} {torch.get_num_threads()}".encode())
        os._exit(0)
    os.close(write)
    inherited, applied = (int(x) for x in os.read(read, 64).split())
    os.close(read)
    os.waitpid(pid, 0)
    assert inherited == before  # what a fork keeps without the fix ...
    assert applied == want  # ... and what a new interpreter given OMP_NUM_THREADS would run
