"""A user's own model, data and loss through the CLI: a task that lives outside the package
(``tests/fixtures/mytask.py`` and its ``conf/`` groups) trains with ``--config-dir`` on world 2, K=4,
keeps its trained weights, passes ``distaccum verify`` in fp64 and fp32, and every bad input is
one paragraph and exit 2 before any worker starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distaccum.rundir.weights import load_weights

pytestmark = pytest.mark.dist

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TASK = ("--config-dir", str(FIXTURES / "conf"), "model=mytask", "data=mytask", "loss=mytask")
SPLIT = ("trainer.nproc=2", "accum.micro_batch=2", "accum.steps=4")


def distaccum(command: str, run_dir: Path, *args: str, timeout: float = 240,
              cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(FIXTURES), "PYTHONUNBUFFERED": "1"}
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "distaccum", command, *args, f"run_dir={run_dir}"],
                          cwd=cwd or run_dir.parent, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("own") / "run"
    proc = distaccum("train", run_dir, *TASK, *SPLIT, "trainer.max_steps=6", "log.console=quiet")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return run_dir


def test_own_task_trains_through_the_cli(trained: Path) -> None:
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((trained / "summary.json").read_text())
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert summary["model"] == "mytask.make_model" and summary["world_size"] == 2 and summary["accum_steps"] == 4
    assert all(r["comm_rounds"] == 1 for r in records)  # one reduction per optimizer step
    assert any(r["micro_items_min"] != r["micro_items_max"] for r in records)  # variable-length samples
    assert all(0 < r["loss"] < 10 for r in records)
    config = json.loads((trained / "config.json").read_text())
    assert config["model"]["_target_"] == "mytask.make_model" and config["components"]["loss"] == "mytask.loss_sum"


def test_final_weights_reproduce_the_trained_model(trained: Path) -> None:
    sys.path.insert(0, str(FIXTURES))
    try:
        import mytask
    finally:
        sys.path.remove(str(FIXTURES))
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["final_model"] == str(trained / "final")
    state = load_weights(trained / "final")
    assert set(state) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}  # no "module." prefix
    model = mytask.make_model()
    model.load_state_dict(state)
    total = torch.zeros((), dtype=torch.float64)
    for _, p in model.named_parameters():
        total += p.detach().double().sum()
    assert float(total) == summary["param_sum"]  # bit for bit
    config = json.loads((trained / "final" / "run_config.json").read_text())
    assert config["model"] == {"_target_": "mytask.make_model", "dim": 4, "hidden": 16}


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_verify_passes_on_the_own_task(tmp_path: Path, precision: str) -> None:
    proc = distaccum("verify", tmp_path / "v", *TASK, *SPLIT, "trainer.max_steps=4", f"precision={precision}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "v" / "verify.json").read_text())
    cand = result["candidates"][0]
    assert result["passed"] and result["model"] == "mytask.make_model"
    bound = {"fp64": 1e-9, "fp32": 1e-4}[precision]  # the stated tolerances (per step, relative)
    assert cand["max_loss_diff"] <= bound * max(1.0, abs(result.get("final_loss", 1.0)))
    if precision == "fp64":
        assert cand["max_rel_diff"] <= 1e-9


def test_a_mean_reduced_loss_exits_2_from_the_probe(tmp_path: Path) -> None:
    proc = distaccum("train", tmp_path / "mean", *TASK[:-1], "loss=mytask_mean", *SPLIT, "trainer.max_steps=2")
    assert proc.returncode == 2, proc.stderr
    assert "loss mytask.loss_mean does not return a sum" in proc.stderr and "That is a mean" in proc.stderr
    assert "equivalent to `" not in proc.stdout  # no worker was started
    assert not (tmp_path / "mean" / "metrics.jsonl").exists()


BAD = {
    "unimportable target": (("model._target_=mytask.no_such_factory",),
                            "model: cannot import _target_ 'mytask.no_such_factory'"),
    "factory returns no module": (("model._target_=builtins.dict",), "returned a dict, not a torch.nn.Module"),
    "empty dataset": (("data.dataset.size=0",), "is empty"),
    "collate fails": (("data.collate._target_=torch.stack",), "collate torch.stack failed on sample 0"),
    "global batch larger than the dataset": (("data.dataset.size=10", "data.drop_last=true"),
                                             "larger than the dataset (10 samples) with data.drop_last=true"),
    "init_from missing": (("trainer.init_from=/nonexistent/model.safetensors",), "no weights at /nonexistent"),
    "loss returns a non-scalar": (("loss._target_=mytask.loss_per_sample",),
                                  "loss mytask.loss_per_sample returned a loss_sum of shape (2,)"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_paragraph_and_exit_2(tmp_path: Path, case: str) -> None:
    overrides, fragment = BAD[case]
    proc = distaccum("train", tmp_path / "bad", *TASK, *SPLIT, *overrides, "trainer.max_steps=2", timeout=120)
    assert proc.returncode == 2, (case, proc.stdout[-1000:], proc.stderr[-3000:])
    assert fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "equivalent to `" not in proc.stdout
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_an_unwritable_run_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    proc = distaccum("train", blocker / "run", *TASK, *SPLIT, "trainer.max_steps=2", timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"run_dir='{blocker / 'run'}' cannot be created: {blocker} is not a directory" in proc.stderr
