"""The Python API in a user's own torchrun script: ``examples/own_loop.py`` (own model, data, loss) under
``torchrun --nproc_per_node=2`` writes what the CLI writes and matches the single-process reference;
``distaccum verify --script`` reruns it as that reference and as the candidate and compares."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, torchrun
from distaccum.rundir.weights import load_weights

pytestmark = pytest.mark.dist

SCRIPT = REPO / "examples" / "own_loop.py"
ARGS = ("--precision", "fp64", "--steps", "4", "--micro-batch", "2", "--global-batch", "16")


def clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DISTACCUM_VERIFY")
    }
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("api")
    proc = torchrun(
        str(SCRIPT), *ARGS, "--run-dir", str(root / "torchrun"), cwd=root, env=clean_env(), timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    verify = subprocess.run(
        [
            sys.executable,
            "-m",
            "distaccum",
            "verify",
            "--script",
            str(SCRIPT),
            "--run-dir",
            str(root / "verify"),
            "--",
            *ARGS,
        ],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    return root / "torchrun", root / "verify", verify.stdout + verify.stderr if verify.returncode else ""


def read(run_dir: Path, name: str) -> list[dict] | dict:
    text = (run_dir / name).read_text()
    return [json.loads(line) for line in text.splitlines()] if name.endswith(".jsonl") else json.loads(text)


def test_the_script_writes_what_the_cli_writes(runs: tuple[Path, Path, str]) -> None:
    run_dir = runs[0]
    records, summary = read(run_dir, "metrics.jsonl"), read(run_dir, "summary.json")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert (summary["world_size"], summary["micro_batch"], summary["accum_steps"]) == (2, 2, 4)
    assert all(r["comm_rounds"] == 1 for r in records) and summary["model"] == "__main__.make_model"
    assert (run_dir / "final" / "model.safetensors").is_file() and summary["final_model"] == str(
        run_dir / "final"
    )


def test_the_script_matches_the_single_process_reference(runs: tuple[Path, Path, str]) -> None:
    run_dir, verify_dir, failure = runs
    assert not failure, failure
    reference = verify_dir / "reference"
    assert read(reference, "summary.json")["world_size"] == 1
    for ours, ref in zip(read(run_dir, "metrics.jsonl"), read(reference, "metrics.jsonl"), strict=True):
        assert (ours["samples"], ours["items"]) == (ref["samples"], ref["items"])
        assert math.isclose(ours["loss"], ref["loss"], rel_tol=1e-9)
        assert math.isclose(ours["grad_norm"], ref["grad_norm"], rel_tol=1e-9)
    trained, plain = load_weights(run_dir / "final"), load_weights(reference / "final")
    assert trained.keys() == plain.keys()
    for name, tensor in plain.items():
        scale = float(tensor.abs().max())
        assert float((trained[name] - tensor).abs().max()) <= 1e-9 * scale + 1e-12, name


def test_verify_script_passes_and_reports(runs: tuple[Path, Path, str]) -> None:
    _, verify_dir, failure = runs
    assert not failure, failure
    result = read(verify_dir, "verify.json")
    assert result["passed"] and result["precision"] == "fp64" and result["global_batch"] == 16
    (cand,) = result["candidates"]
    assert (cand["world_size"], cand["micro_batch"], cand["accum_steps"]) == (2, 2, 4)
    assert cand["max_rel_diff"] <= 1e-9


def test_verify_script_refuses_a_missing_file(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "distaccum", "verify", "--script", str(tmp_path / "nope.py")],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "no such file" in proc.stderr
