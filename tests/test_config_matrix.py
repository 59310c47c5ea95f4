"""Every combination the config accepts either trains or is refused up front.

The matrix: engine (DDP, FSDP2, DeepSpeed ZeRO 0-3, Accelerate) x optimizer (sgd, adamw) x precision
(fp32, fp64, bf16, fp16) x sync mode (boundary, every_micro), on a tiny MLP, CPU. For each cell:

- refused: the pre-flight ``distaccum train`` runs before any worker starts
  (:func:`distaccum.preflight.preflight`) raises ``ConfigError`` (exit 2) with the reason in
  :data:`REFUSALS`; nothing else may refuse;
- accepted: the cell trains one optimizer step on 2 ranks (micro-batch 2 x 2 steps) through the
  public ``Trainer``: the step is applied, the tripwire passes, the final model is saved, and the
  recorded loss and grad_norm equal the plain fp64 values at the seed weights within the
  precision's rounding — so a cell cannot "train" with a wrong gradient scale either. fp16 (DDP
  only, on CPU) trains 3 steps: GradScaler's first scale overflows this model, so step 1 is a
  skip by design; a skip must show a non-finite norm, and the last step must apply.

``engine=deepspeed optim.name=sgd`` is one of the cells: DeepSpeed only trusts its own optimizers
under ZeRO unless ``zero_allow_untested_optimizer`` is set (distaccum sets it).

Accepted cells share one 2-rank launch: this file doubles as the worker script, running the cells
one after another in one process group (launch cost dominates on 2 cores).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ENGINES, EXTENSIONS, forked_torchrun, fresh_accelerate_state
from distaccum.cluster.forked import leave
from distaccum.config import ConfigError, from_mapping
from distaccum.preflight import instantiate_components, preflight

pytestmark = pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")

OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("fp32", "fp64", "bf16", "fp16")
SYNCS = ("boundary", "every_micro")
CELLS = [f"{e}-{o}-{p}-{s}" for e, o, p, s in itertools.product(ENGINES, OPTIMIZERS, PRECISIONS, SYNCS)]
WORLD, MICRO, K, SAMPLES = 2, 2, 2, 8  # one full window of 8 samples
# The recorded step-1 loss and grad_norm against the plain fp64 values (relative): rounding only,
# about 10x the worst measured over all cells (fp64 4e-16, fp32 8e-8, bf16 6e-4, fp16 loss 5e-5).
TOLERANCE = {"fp64": 1e-12, "fp32": 1e-6, "bf16": 5e-3, "fp16": 5e-3}
# fp16: GradScaler's first scale (2^16) overflows this model's gradients, so the first step is
# skipped by design and the scaler backs off; two more steps let one apply.
STEPS = {"fp64": 1, "fp32": 1, "bf16": 1, "fp16": 3}


def refusal(engine: str, precision: str, sync: str) -> str | None:
    """What pre-flight must say for a refused cell (on CPU), or None for a cell that must train."""
    name, stage = ENGINES[engine]["name"], ENGINES[engine].get("zero_stage")
    if name == "deepspeed" and sync == "every_micro" and stage in (0, 1):
        return "accum.sync=every_micro with engine=deepspeed"  # ZeRO-0/1 reduce only at the boundary
    if name == "deepspeed" and precision == "fp64":
        return "precision=fp64 with engine=deepspeed"  # ZeRO-0 refuses fp64; ZeRO 1-3 keep fp32 masters
    if name == "deepspeed" and precision == "bf16" and stage == 0:
        return "precision=bf16 with engine=deepspeed engine.zero_stage=0"  # FP16_UnfusedOptimizer's zero-grad step
    if precision == "fp16" and name == "deepspeed":
        return "engine=deepspeed precision=fp16"  # its loss scaler would fight the window normalization
    if precision == "fp16" and name == "fsdp":
        return "precision=fp16 with engine=fsdp"  # needs a sharded GradScaler
    if precision == "fp16" and name == "accelerate":
        return "engine=accelerate precision=fp16 needs a GPU"  # on CPU it would silently train fp32
    return None


def cell_config(cell: str, root: Path, seed: Path) -> dict[str, Any]:
    """The cell's configuration (a mapping, as ``distaccum train`` resolves it)."""
    engine, optimizer, precision, sync = cell.split("-")
    return {
        "model": {"_target_": "distaccum.models.MLP", "in_dim": 32, "width": 16, "depth": 1, "out_dim": 8},
        "data": {
            "dataset": {"_target_": "distaccum.datasets.SyntheticRegression", "num_samples": SAMPLES},
            "shuffle": False,
        },
        "loss": {"_target_": "distaccum.losses.mse", "_partial_": True},
        "engine": {**ENGINES[engine], "extensions_dir": str(EXTENSIONS)},
        "accum": {"micro_batch": MICRO, "steps": K, "sync": sync},
        "optim": {"name": optimizer},
        "precision": precision,
        "trainer": {
            "nproc": WORLD,
            "max_steps": STEPS[precision],
            "check_every": 1,
            "device": "cpu",
            "init_from": str(seed),
        },
        "log": {"console": "quiet"},
        "run_dir": str(root / cell),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The matrix's directory, with the seed weights every cell starts from."""
    path = tmp_path_factory.mktemp("matrix")
    torch.manual_seed(0)
    parts = instantiate_components(from_mapping(cell_config(CELLS[0], path, path / "seed.safetensors")))
    save_file(
        {k: v.contiguous() for k, v in parts.model().state_dict().items()}, str(path / "seed.safetensors")
    )
    return path


@pytest.fixture(scope="module")
def plain(root: Path) -> dict[str, float]:
    """The step-1 loss and gradient norm of one plain fp64 forward/backward over the window."""
    parts = instantiate_components(from_mapping(cell_config(CELLS[0], root, root / "seed.safetensors")))
    net = parts.model().double()
    net.load_state_dict(load_file(str(root / "seed.safetensors")))
    x, y = zip(*(parts.dataset[i] for i in range(SAMPLES)), strict=True)
    loss_sum, items = parts.loss(net, (torch.stack(x).double(), torch.stack(y).double()))
    (loss_sum / items).backward()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in net.parameters()]))
    return {"loss": float(loss_sum.detach()) / items, "grad_norm": float(norm)}


@pytest.fixture(scope="module")
def trained(root: Path) -> str:
    """Train every accepted cell, one after another in one 2-rank process group; the workers' stdout."""
    plan = [cell_config(c, root, root / "seed.safetensors") for c in CELLS if refusal(*_parts(c)) is None]
    plan_file = root / "plan.json"
    plan_file.write_text(json.dumps(plan))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    proc = forked_torchrun(str(Path(__file__)), str(plan_file), nproc=WORLD, cwd=root, env=env, timeout=900)
    if proc.returncode:
        pytest.fail(
            f"a matrix cell crashed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc.stdout


def _parts(cell: str) -> tuple[str, str, str]:
    engine, _, precision, sync = cell.split("-")
    return engine, precision, sync


@pytest.mark.unit
@pytest.mark.parametrize("cell", [c for c in CELLS if refusal(*_parts(c))])
def test_refused_cells_exit_2_before_workers_start(root: Path, cell: str) -> None:
    cfg = from_mapping(cell_config(cell, root, root / "seed.safetensors"))
    with pytest.raises(ConfigError) as err:
        preflight(cfg, WORLD, write=False)
    assert refusal(*_parts(cell)) in str(err.value)
    assert "use " in str(err.value).lower()  # names the fix, not only the problem


@pytest.mark.dist
@pytest.mark.parametrize("cell", [c for c in CELLS if refusal(*_parts(c)) is None])
def test_accepted_cells_train_one_step(root: Path, plain: dict[str, float], trained: str, cell: str) -> None:
    preflight(from_mapping(cell_config(cell, root, root / "seed.safetensors")), WORLD, write=False)
    run_dir = root / cell
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    precision = _parts(cell)[1]
    assert len(records) == STEPS[precision]
    assert (run_dir / "final" / "model.safetensors").is_file()
    first = records[0]
    assert first["loss"] == pytest.approx(plain["loss"], rel=TOLERANCE[precision], abs=0), (
        first["loss"],
        plain,
    )
    if precision == "fp16":  # an overflow skip must say so and leave a non-finite norm
        assert all(r["skipped"] != math.isfinite(r["grad_norm"]) for r in records), records
        assert not records[-1]["skipped"], records
    else:
        assert not first["skipped"]
        assert first["grad_norm"] == pytest.approx(plain["grad_norm"], rel=TOLERANCE[precision], abs=0), (
            first["grad_norm"],
            plain,
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == ENGINES[cell.split("-")[0]]["name"] and summary["steps"] == STEPS[precision]


def _worker_main(plan_file: str) -> None:
    """Worker entry (under torch.distributed.run): train each cell's config, then leave like the CLI's workers.

    A crash names the cell and exits non-zero (torchrun then stops the other rank).
    """
    from distaccum.runtime.contracts import DistEnv
    from distaccum.runtime.procgroup import ensure_process_group, shutdown
    from distaccum.trainer import Trainer

    code = 0
    cell = "?"
    try:
        ensure_process_group(DistEnv.from_environ(os.environ), torch.device("cpu"))
        for values in json.loads(Path(plan_file).read_text()):
            cfg = from_mapping(values)
            cell = Path(cfg.run_dir).name
            fresh_accelerate_state()  # each cell stands for its own `distaccum train` process
            parts = instantiate_components(cfg)
            Trainer(cfg, model=parts.model, dataset=parts.dataset, loss=parts.loss, names=parts.names).fit()
        shutdown()
    except BaseException:  # noqa: BLE001 - report, then exit non-zero so the test shows it
        print(f"matrix cell {cell} crashed:", file=sys.stderr)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    leave(code)  # os._exit, except a forked rank that succeeded returns to torch's launcher


if __name__ == "__main__":
    _worker_main(sys.argv[1])
