"""``distaccum plan`` end to end: the table of every split, ``--run`` training the recommendation, and
``--sweep``'s multirun command measuring every split for ``distaccum report``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from distaccum.tuning.scaleout import MODES

pytestmark = pytest.mark.dist


def test_plan_run_and_sweep(tmp_path: Path) -> None:
    plan_dir = tmp_path / "plan"
    measure = ("--sweep", "--run", "--rounds", "2", "--steps", "1")
    # 2 x 1 GPUs: the configured global batch of 8 splits on that world at every measured micro-batch (on 4 ranks a
    # micro-batch of 4 could not: the cluster prediction keeps the global batch, tests/test_scaleout.py)
    cluster = ("--nodes", "2", "--gpus-per-node", "1", "--inter-node-gbps", "10", "--intra-node-gbps", "100")
    # a ramp (4 for steps 1-2, then 8): the plan shows each phase's K and predicted step time; the sweep and --run
    # train with it
    config = ("model=mlp", "accum.global_batch=8", "trainer.max_steps=3", "accum.ramp.points=[[1,4],[3,8]]")
    run = run_cli("plan", plan_dir, *config, *measure, *cluster, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    plan = json.loads((plan_dir / "plan.json").read_text())
    rows = {(p["split"]["micro_batch"], p["split"]["accum_steps"]): p for p in plan["predictions"]}
    assert set(rows) == {(1, 4), (2, 2), (4, 1)} and all(p["fits"] and p["step_s"] > 0 for p in rows.values())
    rec = plan["recommended"]
    assert rows[(rec["micro_batch"], rec["accum_steps"])]["step_s"] == min(p["step_s"] for p in rows.values())
    for label in ("w2-m1-k4", "w2-m2-k2", "w2-m4-k1"):
        assert f"| {label} |" in run.stdout
    assert f"recommended: accum.micro_batch={rec['micro_batch']}" in run.stdout
    assert (plan_dir / "plan.md").read_text().strip() in run.stdout
    costs = {c["micro_batch"]: c for c in plan["costs"]}
    phase = next(line for line in run.stdout.splitlines() if line.startswith("| 1-2 | 4 |"))
    assert phase.startswith("| 1-2 | 4 | w2-m2-k1 (K=1) |")  # the default micro-batch 4 lowered to 2 per rank
    step_ms = costs[2]["base_s"] + (1 - costs[2]["trial_accum"]) * costs[2]["micro_s"]
    assert f"| {step_ms * 1e3:.1f} ms |" in phase
    assert "| 3-3 | 8 | w2-m4-k1 (K=1) |" in run.stdout and "whole ramp, 3 steps, 16 samples" in run.stdout
    # --nodes: every engine and sync mode predicted for 2 x 1 GPUs from the compute the trials measured
    assert "PREDICTION for 2 nodes x 1 GPUs = 2 ranks: not a measurement" in run.stdout
    assert f"(measured here: micro-batch {rec['micro_batch']}, median of" in run.stdout
    predicted = [
        line.split(" | ")[0][2:] for line in run.stdout.splitlines() if line.endswith("| predicted |")
    ]
    assert predicted[: len(MODES)] == [m.key for m in MODES]
    # --run trained the recommendation
    trained = json.loads((plan_dir / "train" / "summary.json").read_text())
    assert (trained["micro_batch"], trained["global_batch"], trained["steps"]) == (rec["micro_batch"], 8, 3)
    # --sweep: one multirun over the micro-batch with the global batch fixed, then the report
    script = (plan_dir / "sweep.sh").read_text()
    assert (
        "distaccum train --multirun model=mlp trainer.max_steps=3 'accum.ramp.points=[[1,4],[3,8]]' log.console=quiet"
        in script
    )
    assert f"accum.global_batch=8 accum.micro_batch=1,2,4 run_dir={plan_dir / 'sweep'}" in script
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    sweep = subprocess.run(
        ["sh", str(plan_dir / "sweep.sh")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    report = (plan_dir / "sweep" / "report.md").read_text()
    assert "3 runs: 3 ok" in report and "All 3 comparable runs agree" in report
    for split in ("1x4x2=8", "2x2x2=8", "4x1x2=8"):
        assert split in report
