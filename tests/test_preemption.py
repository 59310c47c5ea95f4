"""A run stopped by SIGTERM finishes its window, checkpoints, and resumes at the exact next sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import line_count, sigterm_at_step, train

pytestmark = pytest.mark.dist

ARGS = (
    "model=mlp",
    "model.width=16",
    "accum.micro_batch=2",
    "accum.steps=2",
    "precision=fp64",
    "trainer.max_steps=400",
    "trainer.check_every=0",
    "log.console=quiet",
)


def test_sigterm_checkpoints_at_a_window_boundary_and_resumes(tmp_path: Path) -> None:
    run_dir = tmp_path / "stopped"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "distaccum", "train", *ARGS, f"run_dir={run_dir}"]
    returncode, err = sigterm_at_step(cmd, run_dir, 5, env, timeout=120)
    assert returncode == 3, err[-3000:]
    assert "rerun the same command to resume" in err
    done = line_count(run_dir / "metrics.jsonl")
    checkpoint = run_dir / "checkpoints" / f"step-{done:08d}"
    assert (checkpoint / "manifest.json").is_file()
    assert 5 <= done < 400, "the run ended before the signal: raise trainer.max_steps"

    resumed = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint} after optimizer step {done}" in resumed.stdout
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 401))  # no window lost, none repeated

    straight = train(tmp_path / "straight", *ARGS)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["param_sum"] == pytest.approx(straight.summary["param_sum"], rel=1e-12)
    assert summary["param_l2"] == pytest.approx(straight.summary["param_l2"], rel=1e-12)
