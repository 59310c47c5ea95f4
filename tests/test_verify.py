"""`distaccum verify` end to end: real launches (gloo), a passing matrix and the negative controls.

Each fixture is one ``distaccum verify`` invocation (a reference plus candidates, ~5 s per run on 2
idle cores), shared by the tests that read it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import Run, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def verify(tmp_path_factory: pytest.TempPathFactory, name: str, *overrides: str) -> tuple[Run, float]:
    run_dir = tmp_path_factory.mktemp(name) / "verify"
    start = time.perf_counter()
    run = run_cli("verify", run_dir, *overrides, timeout=280)
    return run, time.perf_counter() - start


def report(run: Run) -> dict[str, Any]:
    return json.loads((run.run_dir / "verify.json").read_text())


MATRIX = {
    # 3 splits each; tiny_gpt fp32 for 10 steps is also the "under 2 minutes" acceptance run
    "gpt_fp32": ("model=tiny_gpt", "trainer.max_steps=10"),
    "gpt_fp64": ("model=tiny_gpt", "precision=fp64", "trainer.max_steps=5"),
    "mlp_fp32_ref_fp64": ("model=mlp", "verify.reference_dtype=fp64", "trainer.max_steps=5"),
    "mlp_fp64": ("model=mlp", "precision=fp64", "trainer.max_steps=5"),
}


@pytest.fixture(scope="module", params=sorted(MATRIX))
def passing(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run, float]:
    name = request.param
    run, seconds = verify(tmp_path_factory, name, *MATRIX[name], "verify.splits=auto", "verify.max_candidates=3")
    return name, run, seconds


def test_matrix_passes_with_three_splits(passing: tuple[str, Run, float]) -> None:
    name, run, seconds = passing
    assert run.returncode == 0, run.stdout + run.stderr
    out = report(run)
    assert out["passed"] is True
    cands = out["candidates"]
    splits = {(c["world_size"], c["micro_batch"], c["accum_steps"]) for c in cands}
    assert len(cands) == 3 and len(splits) == 3
    assert {w for w, _, _ in splits} == {1, 2}
    tol = out["tolerance"]["params"]
    for c in cands:
        assert c["world_size"] * c["micro_batch"] * c["accum_steps"] == out["global_batch"] == 32
        assert c["passed"] and c["first_divergence"] is None and c["diagnosis"] == []
        assert c["engine"] == "ddp" and c["steps_compared"] == out["steps"]
        assert c["max_rel_diff"] <= tol["rtol"] + tol["atol"]  # loose bound: max|ref| of a tensor is < 1 here
    assert out["reference"]["precision"] == ("fp64" if "fp64" in name else "fp32")
    assert out["reference"]["world_size"] == 1 and out["reference"]["accum_steps"] == 1
    assert "PASS" in run.stdout and "tolerance (" in run.stdout
    if name == "gpt_fp32":
        assert seconds < 120, f"3-split verify of tiny_gpt for 10 steps took {seconds:.0f} s"


def test_reference_and_candidates_really_trained_the_same_model(passing: tuple[str, Run, float]) -> None:
    """Independent of compare(): the files agree, the model moved, and every step was checksummed."""
    name, run, _ = passing
    ref_dir = run.run_dir / "reference"
    seed = torch.load(run.run_dir / "seed.pt", weights_only=True)
    ref = torch.load(ref_dir / "final_params.pt", weights_only=True)
    assert any(not torch.allclose(ref[k].double(), seed[k].double()) for k in ref)
    bound = 1e-9 if name.endswith("fp64") and "ref" not in name else 5e-3
    for c in report(run)["candidates"]:
        cand = torch.load(Path(c["run_dir"]) / "final_params.pt", weights_only=True)
        assert cand.keys() == ref.keys()
        for k in ref:
            scale = float(ref[k].double().abs().max()) + 1e-12
            assert float((cand[k].double() - ref[k].double()).abs().max()) / scale < bound, k
        rows = (Path(c["run_dir"]) / "checksums.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows] == list(range(1, report(run)["steps"] + 1))


@pytest.fixture(scope="module")
def mean_per_micro(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return verify(tmp_path_factory, "mean", "model=tiny_gpt", "accum.loss_norm=mean_per_micro",
                  "trainer.max_steps=3")[0]


@pytest.fixture(scope="module")
def batchnorm(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return verify(tmp_path_factory, "bn", "model=convnet_bn", "accum.steps=4", "trainer.max_steps=3")[0]


@pytest.fixture(scope="module")
def desync(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return verify(tmp_path_factory, "desync", "model=tiny_gpt", "debug.skip_reduction_rank=1",
                  "trainer.max_steps=3")[0]


@pytest.fixture(scope="module")
def dropout(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return verify(tmp_path_factory, "dropout", "model=mlp", "model.dropout=0.2", "trainer.max_steps=2")[0]


def failed_candidate(run: Run) -> dict[str, Any]:
    assert run.returncode == 1, run.stdout + run.stderr
    out = report(run)
    assert out["passed"] is False
    [cand] = out["candidates"]
    assert cand["passed"] is False
    return cand


def test_mean_per_micro_fails_with_loss_normalization_diagnosis(mean_per_micro: Run) -> None:
    cand = failed_candidate(mean_per_micro)
    assert [d["cause"] for d in cand["diagnosis"]] == ["loss_normalization"]
    assert "loss items" in cand["diagnosis"][0]["message"]
    # the loss is reported correctly either way; the gradient is what the wrong weighting changes
    assert cand["first_divergence"]["step"] == 1 and cand["first_divergence"]["quantity"] == "grad_norm"
    assert "loss_normalization" in mean_per_micro.stdout


def test_batchnorm_fails_naming_the_layers(batchnorm: Run) -> None:
    cand = failed_candidate(batchnorm)
    assert cand["accum_steps"] == 4
    assert [d["cause"] for d in cand["diagnosis"]] == ["batch_statistics"]
    assert "features.1, features.4" in cand["diagnosis"][0]["message"]
    assert cand["first_divergence"]["step"] == 1


def test_dropout_fails_with_randomness_diagnosis(dropout: Run) -> None:
    cand = failed_candidate(dropout)
    assert [d["cause"] for d in cand["diagnosis"]] == ["randomness"]
    assert "model.dropout=0" in cand["diagnosis"][0]["message"]
    assert cand["first_divergence"]["step"] == 1


def test_desynchronized_rank_is_caught_by_the_tripwire(desync: Run) -> None:
    cand = failed_candidate(desync)
    assert cand["exit_code"] == 1  # the tripwire stopped the run
    first = cand["first_divergence"]
    assert (first["step"], first["quantity"]) == (1, "ranks") and first["parameter"]
    assert [d["cause"] for d in cand["diagnosis"]] == ["rank_divergence"]
    tripwire = json.loads((Path(cand["run_dir"]) / "divergence.json").read_text())
    assert (tripwire["step"], tripwire["parameter"], tripwire["rank"]) == (1, first["parameter"], 1)
    assert "ranks diverged after optimizer step 1" in desync.stdout
    assert "RankDivergenceError" in (Path(cand["run_dir"]) / "console.log").read_text()


def test_bad_config_exits_2_before_any_run(tmp_path: Path) -> None:
    run = run_cli("verify", tmp_path / "v", "accum.global_batch=33", timeout=60)
    assert run.returncode == 2, run.stdout + run.stderr
    assert "global_batch=33" in run.stderr
    assert not (tmp_path / "v" / "reference").exists()
