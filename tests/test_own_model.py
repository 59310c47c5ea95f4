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
from typing import Any

import pytest
import torch

from conftest import distaccum_cli
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.rundir.weights import load_weights

pytestmark = pytest.mark.dist

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TASK = ("--config-dir", str(FIXTURES / "conf"), "model=mytask", "data=mytask", "loss=mytask")
SPLIT = ("trainer.nproc=2", "accum.micro_batch=2", "accum.steps=4")


def distaccum(
    command: str, run_dir: Path, *args: str, timeout: float = 240, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(FIXTURES), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(var, None)
    return distaccum_cli(
        [command, *args, f"run_dir={run_dir}"], cwd=cwd or run_dir.parent, env=env, timeout=timeout
    )


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
    assert (
        summary["model"] == "mytask.make_model" and summary["world_size"] == 2 and summary["accum_steps"] == 4
    )
    assert all(r["comm_rounds"] == 1 for r in records)  # one reduction per optimizer step
    assert any(r["micro_items_min"] != r["micro_items_max"] for r in records)  # variable-length samples
    assert all(0 < r["loss"] < 10 for r in records)
    config = json.loads((trained / "config.json").read_text())
    assert (
        config["model"]["_target_"] == "mytask.make_model"
        and config["components"]["loss"] == "mytask.loss_sum"
    )


def import_mytask() -> Any:
    sys.path.insert(0, str(FIXTURES))
    try:
        import mytask
    finally:
        sys.path.remove(str(FIXTURES))
    return mytask


def test_final_weights_reproduce_the_trained_model(trained: Path) -> None:
    mytask = import_mytask()
    summary = json.loads((trained / "summary.json").read_text())
    assert summary["final_model"] == str(trained / "final")
    state = load_weights(trained / "final")
    assert set(state) == {
        "body.0.weight",
        "body.0.bias",
        "body.2.weight",
        "body.2.bias",
    }  # no "module." prefix
    model = mytask.make_model()
    model.load_state_dict(state)
    total = torch.zeros((), dtype=torch.float64)
    for _, p in model.named_parameters():
        total += p.detach().double().sum()
    assert float(total) == summary["param_sum"]  # bit for bit
    config = json.loads((trained / "final" / "run_config.json").read_text())
    assert config["model"] == {"_target_": "mytask.make_model", "dim": 4, "hidden": 16}


def test_init_from_a_torch_save_state_dict_trains_and_a_bad_file_exits_2(
    trained: Path, tmp_path: Path
) -> None:
    """The most common PyTorch weights file starts a run; a file that is no weights is refused before any
    worker starts, naming trainer.init_from (not the model factory) and the accepted formats."""
    torch.save(load_weights(trained / "final"), tmp_path / "weights.pt")
    proc = distaccum(
        "train",
        tmp_path / "from_pt",
        *TASK,
        *SPLIT,
        "trainer.max_steps=1",
        "log.console=quiet",
        f"trainer.init_from={tmp_path / 'weights.pt'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads((tmp_path / "from_pt" / "metrics.jsonl").read_text().splitlines()[0])
    # Its step-1 loss is what the trained weights give on the plan's first window (computed here).
    mytask = import_mytask()
    data = mytask.Corpus()
    window = GlobalBatchOrder(len(data), 16, seed=0).window(0).indices.tolist()
    model = mytask.make_model()
    model.load_state_dict(load_weights(trained / "final"))
    with torch.no_grad():
        total, items = mytask.loss_sum(model, mytask.collate([data[i] for i in window]))
    assert resumed["loss"] == pytest.approx(float(total / items), rel=1e-5)
    (tmp_path / "notes.bin").write_text("these are not weights\n")
    bad = distaccum(
        "train",
        tmp_path / "bad",
        *TASK,
        *SPLIT,
        "trainer.max_steps=1",
        f"trainer.init_from={tmp_path / 'notes.bin'}",
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert f"trainer.init_from={tmp_path / 'notes.bin'}: weights file" in bad.stderr
    assert "mytask.make_model failed" not in bad.stderr and "equivalent to `" not in bad.stdout


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
    proc = distaccum(
        "train", tmp_path / "mean", *TASK[:-1], "loss=mytask_mean", *SPLIT, "trainer.max_steps=2"
    )
    assert proc.returncode == 2, proc.stderr
    assert "loss mytask.loss_mean does not return a sum" in proc.stderr and "That is a mean" in proc.stderr
    assert "equivalent to `" not in proc.stdout  # no worker was started
    assert not (tmp_path / "mean" / "metrics.jsonl").exists()


BAD = {
    "unimportable target": (
        ("model._target_=mytask.no_such_factory",),
        "model: cannot import _target_ 'mytask.no_such_factory'",
    ),
    "factory returns no module": (
        ("model._target_=builtins.dict",),
        "returned a dict, not a torch.nn.Module",
    ),
    "empty dataset": (("data.dataset.size=0",), "is empty"),
    "collate fails": (("data.collate._target_=torch.stack",), "collate torch.stack failed on sample 0"),
    "global batch larger than the dataset": (
        ("data.dataset.size=10", "data.drop_last=true"),
        "larger than the dataset (10 samples) with data.drop_last=true",
    ),
    "init_from missing": (
        ("trainer.init_from=/nonexistent/model.safetensors",),
        "no weights at /nonexistent",
    ),
    "loss returns a non-scalar": (
        ("loss._target_=mytask.loss_per_sample",),
        "loss mytask.loss_per_sample returned a loss_sum of shape (2,)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_one_paragraph_and_exit_2(tmp_path: Path, case: str) -> None:
    overrides, fragment = BAD[case]
    proc = distaccum("train", tmp_path / "bad", *TASK, *SPLIT, *overrides, "trainer.max_steps=2", timeout=120)
    assert proc.returncode == 2, (case, proc.stdout[-1000:], proc.stderr[-3000:])
    assert fragment in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "equivalent to `" not in proc.stdout
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


@pytest.mark.parametrize(("command", "where"), [("train", "file"), ("train", "proc"), ("verify", "proc")])
def test_an_unwritable_run_dir_is_a_clear_error(tmp_path: Path, command: str, where: str) -> None:
    """A file in the way, or a path nobody can create (``/proc/x``, which looks writable to root): one
    paragraph, exit 2, no traceback (Hydra's output directory would otherwise fail with two)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run_dir = blocker / "run" if where == "file" else Path("/proc/distaccum-test/run")
    proc = distaccum(command, run_dir, *TASK, *SPLIT, "trainer.max_steps=2", timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    reason = "Not a directory" if where == "file" else "No such file or directory"
    assert f"run_dir='{run_dir}' cannot be created and written: {reason}" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one paragraph
