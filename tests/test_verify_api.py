"""``distaccum.verify.verify`` from Python, on user components (no CLI): the README's example as it is,
and a user component with a bug injected from outside, which the returned result must name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from distaccum.config import ConfigError
from distaccum.verify import verify

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FIXTURES = REPO / "tests" / "fixtures"
MYTASK = {
    "model": {"_target_": "mytask.make_model", "dim": 4, "hidden": 16},
    "data": {
        "dataset": {"_target_": "mytask.Corpus", "size": 48},
        "collate": {"_target_": "mytask.collate", "_partial_": True},
    },
    "accum": {"micro_batch": 2, "global_batch": 16},
    "precision": "fp64",
    "optim": {"name": "sgd", "lr": 0.05},
    "trainer": {"nproc": 2, "max_steps": 3},
}


def test_the_readme_example_verifies_its_own_components(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "verify_from_python.py", str(tmp_path / "v")],
        cwd=REPO / "examples",
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert [line.split()[:2] for line in lines[:3]] == [
        ["w2-m4-k4", "PASS"],
        ["w2-m16-k1", "PASS"],
        ["w1-m8-k4", "PASS"],
    ]
    written = json.loads((tmp_path / "v" / "verify.json").read_text())
    assert written["passed"] and [c["split"] for c in written["candidates"]] == [
        "w2-m4-k4",
        "w2-m16-k1",
        "w1-m8-k4",
    ]
    assert all(c["max_rel_diff"] < 1e-9 for c in written["candidates"])  # fp64: rounding only


def test_a_bug_in_a_user_component_run_is_named_in_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loss is the user's; the bug (a gradient 2x too large on every rank) is injected from outside
    through the testing seam, which the launched workers install when they build the loss."""
    monkeypatch.syspath_prepend(str(FIXTURES))
    monkeypatch.chdir(FIXTURES)  # the workers import mytask from their working directory
    config = {
        **MYTASK,
        "run_dir": str(tmp_path / "bug"),
        "loss": {
            "_target_": "distaccum.testing.Inject",
            "component": {"_target_": "mytask.loss_sum", "_partial_": True},
            "faults": [{"_target_": "distaccum.testing.faults.GradScale", "factor": 2.0}],
        },
    }
    lines: list[str] = []
    result = verify(config, splits=["w2-m2-k4"], echo=lines.append)
    assert not result.passed and result.exit_code == 1
    [row] = result.rows
    assert row.run.split.label() == "w2-m2-k4" and not row.passed
    assert row.report.first_divergence is not None and row.report.first_divergence.step == 1
    assert [f.cause for f in row.findings] == ["gradient_scale"] and "2x" in row.findings[0].message
    assert any("verify FAILED: 0/1" in line for line in lines)
    assert json.loads((tmp_path / "bug" / "verify.json").read_text())["passed"] is False


@pytest.mark.unit
def test_bad_input_is_refused_before_anything_runs(tmp_path: Path) -> None:
    config = {
        **MYTASK,
        "loss": {"_target_": "mytask.loss_sum", "_partial_": True},
        "run_dir": str(tmp_path / "x"),
    }
    with pytest.raises(ConfigError, match="holds 8 samples per step; the configuration's global batch is 16"):
        verify(config, splits=["w2-m2-k2"])
    with pytest.raises(ConfigError, match="w<world>-m<micro_batch>-k<accum_steps>"):
        verify(config, splits=["2x8"])
    assert not (tmp_path / "x").exists()
