"""``accum.reduce_dtype=bf16`` on every engine: the ledger's bytes are half of fp32's, the first step's gradient
norm stays within the derived tolerance of plain fp64 autograd, and a deliberately wrong reduction under bf16
still fails ``distaccum verify``.

Every engine (DDP, Accelerate, FSDP2, DeepSpeed ZeRO 0-3) trains one step with each reduce dtype in ONE
2-rank launch (the worker is tests/test_config_matrix.py's: launch cost dominates on 2 cores).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_config_matrix import ENGINES, WORLD, cell_config, plain, root  # noqa: F401 - plain, root: fixtures

from conftest import fault, forked_torchrun, inject, run_cli

pytestmark = [
    pytest.mark.dist,
    pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning"),
]

REDUCE = ("fp32", "bf16")
CELLS = [(engine, dtype) for engine in ENGINES for dtype in REDUCE]
BF16_U = 2.0**-8
"""bf16's unit roundoff (8 significand bits)."""


def config(engine: str, dtype: str, directory: Path) -> dict[str, Any]:
    """The config matrix's adamw/fp32/boundary cell of ``engine``, reducing in ``dtype``."""
    values = cell_config(f"{engine}-adamw-fp32-boundary", directory, directory / "seed.safetensors")
    values["accum"]["reduce_dtype"] = dtype
    values["run_dir"] = str(directory / f"reduce-{engine}-{dtype}")
    return values


@pytest.fixture(scope="module")
def trained(root: Path) -> dict[tuple[str, str], dict[str, Any]]:  # noqa: F811 - the imported fixture
    """Every cell's first-step record, trained one after another in one 2-rank process group."""
    plan_file = root / "reduce-plan.json"
    plan_file.write_text(json.dumps([config(e, d, root) for e, d in CELLS]))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    worker = Path(__file__).with_name("test_config_matrix.py")
    proc = forked_torchrun(str(worker), str(plan_file), nproc=WORLD, cwd=root, env=env, timeout=900)
    if proc.returncode:
        pytest.fail(f"a cell crashed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {
        (e, d): json.loads((root / f"reduce-{e}-{d}" / "metrics.jsonl").read_text().splitlines()[0])
        for e, d in CELLS
    }


@pytest.mark.parametrize("engine", list(ENGINES))
def test_bf16_reduction_halves_the_bytes_and_stays_within_the_derived_tolerance(
    trained: dict[tuple[str, str], dict[str, Any]],
    plain: dict[str, float],  # noqa: F811 - the fixture imported above
    engine: str,
) -> None:
    full, half = trained[(engine, "fp32")], trained[(engine, "bf16")]
    assert full["comm_bytes"] > 0 and half["comm_bytes"] * 2 == full["comm_bytes"]
    assert half["comm_calls"] == full["comm_calls"] and half["comm_rounds"] == full["comm_rounds"] == 1
    # Step 1 starts from the seed weights: the loss is the plain one; the gradient went through one bf16
    # reduction over W = 2 ranks: n = W roundings, e = n u (distaccum.verify.compare.with_reduction).
    e = WORLD * BF16_U
    assert half["loss"] == pytest.approx(plain["loss"], rel=1e-6, abs=0)
    assert half["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6 + e, abs=0)
    assert full["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-6, abs=0)
    assert half["grad_norm"] != full["grad_norm"]  # the reduction really ran in bf16


def test_a_wrong_reduction_under_bf16_still_fails_verify(tmp_path: Path) -> None:
    # Every reduced gradient 5% too large: far above bf16's rounding (e = 2 x 2^-8 = 0.8%), so the widened
    # tolerance must still catch it at step 1.
    too_large = inject("distaccum.losses.mse", fault("GradScale", factor=1.05))
    bf16 = ("model=mlp", "engine=ddp", "accum.reduce_dtype=bf16", "trainer.nproc=2")
    split = ("accum.micro_batch=2", "accum.steps=2", "trainer.max_steps=2")
    run = run_cli("verify", tmp_path / "verify", *too_large, *bf16, *split, timeout=240)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "verify" / "verify.json").read_text())
    first = result["candidates"][0]["first_divergence"]
    assert (first["step"], first["quantity"]) == (1, "grad_norm")
    assert abs(first["candidate"] / first["reference"] - 1.05) < 0.01
    assert result["tolerance"]["steps"]["rtol"] == pytest.approx(1e-4 + 2 * BF16_U)
    assert "gradients reduced in bf16: + e = 2 roundings" in run.stdout
