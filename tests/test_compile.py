"""torch.compile under accumulation (``trainer.compile=true``), on gloo, world 2, K=4.

Every engine trains the same variable-length causal model (the embedded corpus: sequences of 8-32 tokens,
padded per micro-batch, so the sequence length changes between micro-batches) for 3 windows, the last a
partial one with smaller micro-batches, from the same seed. Compiled, each engine must record its compile
time apart from the step times and train what the eager run trains within fp32 rounding. DDP, Accelerate
and DeepSpeed (dynamic shapes from the start) compile during their first window only: 0 recompiles
afterwards — not for ``no_sync`` toggling between micro-batches, nor for new sequence lengths, nor for the
partial window, nor for gradients zeroed between windows. FSDP2's blocks use automatic dynamic shapes
(:mod:`distaccum.engines.compile` says why): they recompile once, in the first window, when the sequence
length first changes, and never after it.
``distaccum verify`` passes compiled runs at fp32 and fp64 against the eager single-process reference.

The runs share one launch (this file doubles as the worker script, as tests/test_engines.py does).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import EXTENSIONS, PlanRuns, launch_recipe, plan_worker, run_cli
from distaccum.cli.compose import compose_config
from distaccum.config import from_mapping, to_mapping, with_overrides

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

MODEL = [
    "model=tiny_gpt",
    "model.width=16",
    "model.depth=1",
    "data.dataset.num_samples=80",
    "accum.micro_batch=4",
    "accum.steps=4",
    "trainer.nproc=2",
    "trainer.max_steps=3",
    "trainer.check_every=1",
    "optim.lr=1e-2",
    "log.console=quiet",
    f"engine.extensions_dir={EXTENSIONS}",
]
ENGINES: dict[str, list[str]] = {
    "ddp": ["engine=ddp"],
    "fsdp": ["engine=fsdp"],
    "accelerate": ["engine=accelerate"],
    "zero2": ["engine=deepspeed", "engine.zero_stage=2"],
}
"""The engines run compiled, each against the same eager DDP run."""
RUNS: dict[str, list[str]] = {"eager": ["engine=ddp"]} | {
    name: [*engine, "trainer.compile=true"] for name, engine in ENGINES.items()
}
COMPILED = list(ENGINES)


def _worker_main(plan_file: str) -> None:
    """Worker entry (under torch.distributed.run): train each config through the public Trainer."""
    from distaccum.preflight import instantiate_components
    from distaccum.trainer import Trainer

    def train(values: dict[str, Any]) -> None:
        # Each run starts from an empty dynamo cache, as in its own process: otherwise a later run of the
        # same model code reuses the graphs an earlier run compiled, and compiles nothing.
        torch._dynamo.reset()
        cfg = from_mapping(values)
        parts = instantiate_components(cfg)
        Trainer.of(cfg, parts).fit()

    plan_worker(plan_file, train)


Runs = PlanRuns


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("compile")
    plan = [
        to_mapping(with_overrides(compose_config([*MODEL, *overrides]), {"run_dir": str(root / name)}))
        for name, overrides in RUNS.items()
    ]
    proc = launch_recipe(Path(__file__), plan, root)
    return Runs(root, proc.stderr)


RECOMPILES = {"ddp": [0, 0, 0], "accelerate": [0, 0, 0], "zero2": [0, 0, 0], "fsdp": [1, 0, 0]}
"""Recompiles per step: FSDP2's automatic dynamic shapes recompile when the sequence length first changes."""


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_runs_compile_in_the_first_window_only(runs: Runs, name: str) -> None:
    records = runs.records(name)
    # 80 = 32 + 32 + 16: the last window is partial, its micro-batches smaller
    assert [r["partial_window"] for r in records] == [False, False, True]
    assert records[0]["compile_s"] > 0 and records[0]["time_s"] >= records[0]["compile_s"]
    assert [r["recompiles"] for r in records] == RECOMPILES[name], records
    assert [r["compile_s"] for r in records[1:]] == [0.0, 0.0]
    summary = runs.summary(name)
    assert summary["recompiles"] == sum(RECOMPILES[name][1:])  # after the warm-up step
    assert summary["compile_s"] == pytest.approx(sum(r["compile_s"] for r in records))
    assert summary["graph_breaks"] == records[-1]["graph_breaks"] >= 0
    # The step medians leave the compiling step out (warm-up): 3 steps, the median of the last two.
    assert summary["median_time_s"] == pytest.approx((records[1]["time_s"] + records[2]["time_s"]) / 2)


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_equals_eager_within_fp32_rounding(runs: Runs, name: str) -> None:
    eager, compiled = runs.records("eager"), runs.records(name)
    for a, b in zip(eager, compiled, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (name, a["step"])
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (name, a["step"])
    assert runs.summary(name)["param_sum"] == pytest.approx(
        runs.summary("eager")["param_sum"], rel=1e-4, abs=1e-4
    )


def test_no_recompile_was_reported(runs: Runs) -> None:
    assert "torch.compile recompiled" not in runs.output


def check_verify_passes_compiled(run_dir: Path, *overrides: str) -> dict[str, Any]:
    """``distaccum verify`` of a compiled MLP run passes and the candidate really compiled; its report."""
    accum = ("data.dataset.num_samples=40", "accum.micro_batch=4", "accum.steps=2", "trainer.max_steps=3")
    compiled = ("model=mlp", "model.width=32", *accum, "trainer.compile=true", *overrides)
    run = run_cli("verify", run_dir, *compiled, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((run.run_dir / "verify.json").read_text())
    assert result["passed"]
    cand = result["candidates"][0]
    records = [
        json.loads(line) for line in (Path(cand["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    assert records[0]["compile_s"] > 0 and all(r["recompiles"] == 0 for r in records)  # it really compiled
    return cand


@pytest.mark.parametrize("precision", ["fp64", "fp32"])
def test_verify_passes_compiled_runs(tmp_path: Path, precision: str) -> None:
    cand = check_verify_passes_compiled(tmp_path / "v", f"precision={precision}")
    if precision == "fp64":
        assert cand["max_rel_diff"] <= 1e-9


if __name__ == "__main__":
    _worker_main(sys.argv[1])
