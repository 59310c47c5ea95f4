"""``optim.lr_scaling`` with ``optim.base_batch``: the effective learning rate follows the global batch,
warmup stays in optimizer steps, bad values are config errors, and the report shows the effective lr.
Trained runs (records, summary, report over a sweep): test_activation_checkpointing_dist.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from distaccum.config import OptimConfig, from_mapping
from distaccum.optim import build_scheduler, describe_lr
from distaccum.telemetry.report import effective_lr, load_run, table_row

pytestmark = pytest.mark.unit


def schedule(global_batch: int, **optim: object) -> list[float]:
    """The lr each of 8 optimizer steps trains with."""
    cfg = OptimConfig(**{"lr": 0.01, "warmup_steps": 3, "schedule": "cosine", **optim})  # type: ignore[arg-type]
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, 8, global_batch=global_batch)
    lrs = []
    for _ in range(8):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return lrs


def test_linear_doubles_the_lr_when_the_global_batch_doubles() -> None:
    cfg = OptimConfig(lr=0.01, lr_scaling="linear", base_batch=64)
    assert [cfg.lr_scale(g) for g in (32, 64, 128, 256)] == [0.5, 1.0, 2.0, 4.0]
    small, large = (
        schedule(64, lr_scaling="linear", base_batch=64),
        schedule(128, lr_scaling="linear", base_batch=64),
    )
    assert [b / a for a, b in zip(small, large, strict=True)] == pytest.approx([2.0] * 8, rel=1e-15)
    assert small == schedule(64)  # at base_batch nothing changes


def test_sqrt_scales_by_the_square_root_and_none_ignores_the_batch() -> None:
    assert OptimConfig(lr_scaling="sqrt", base_batch=64).lr_scale(256) == 2.0
    assert OptimConfig(lr_scaling="sqrt", base_batch=64).lr_scale(128) == pytest.approx(math.sqrt(2))
    assert OptimConfig(base_batch=64).lr_scale(256) == 1.0
    assert schedule(256) == schedule(64)


def test_warmup_stays_in_optimizer_steps() -> None:
    """The shape of the schedule (warmup length, decay) does not depend on the batch: only its height."""
    for rule in ("linear", "sqrt"):
        lrs = schedule(256, lr_scaling=rule, base_batch=64)
        peak = max(lrs)
        assert lrs.index(peak) == 3  # warmup_steps=3: steps 0-2 ramp up, step 3 is the peak
        assert [x / peak for x in lrs] == pytest.approx(
            [x / max(schedule(64)) for x in schedule(64)], rel=1e-12
        )


def test_the_effective_lr_is_described_once_at_start() -> None:
    cfg = OptimConfig(lr=3e-3, lr_scaling="linear", base_batch=64, warmup_steps=3)
    assert describe_lr(cfg, 128, 3e-3) == (
        "effective lr 0.006 = 0.003 x 128/64 (optim.lr_scaling=linear: global "
        "batch 128, optim.base_batch 64); warmup 3 optimizer steps"
    )
    assert "x sqrt(256/64)" in describe_lr(OptimConfig(lr_scaling="sqrt", base_batch=64), 256, 1e-3)


@pytest.mark.parametrize(
    "optim, fragment",
    [
        ({"base_batch": 0}, "optim.base_batch must be > 0, got 0"),
        ({"base_batch": -64, "lr_scaling": "linear"}, "optim.base_batch must be > 0, got -64"),
        (
            {"lr_scaling": "cubic", "base_batch": 64},
            "optim.lr_scaling='cubic' is not one of none, linear, sqrt",
        ),
        ({"lr_scaling": "linear"}, "optim.lr_scaling=linear needs optim.base_batch"),
    ],
)
def test_bad_values_are_config_errors(optim: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        from_mapping({"optim": optim})
    assert fragment in str(err.value)


def run_dir(tmp_path: Path, name: str, summary: dict | None, optim: dict, samples: int = 128) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0, "samples": samples, "lr": 0.001}) + "\n"
    )
    (path / "config.json").write_text(json.dumps({"optim": optim, "log": {"warmup_steps": 0}}))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_the_report_shows_the_effective_lr(tmp_path: Path) -> None:
    optim = {"lr": 0.003, "lr_scaling": "linear", "base_batch": 64}
    written = run_dir(tmp_path, "a", {"global_batch": 128, "effective_lr": 0.006}, optim)
    assert table_row(load_run(written)).effective_lr == 0.006
    # A run that died before its summary: computed from its config and its first window's samples.
    assert effective_lr(load_run(run_dir(tmp_path, "b", None, optim, samples=256))) == pytest.approx(0.012)
    assert (
        effective_lr(load_run(run_dir(tmp_path, "c", None, {"lr": 0.003}))) == 0.003
    )  # written before lr_scaling
    assert math.isnan(effective_lr(load_run(run_dir(tmp_path, "d", None, {"lr": 0.003, "lr_scaling": "x"}))))
