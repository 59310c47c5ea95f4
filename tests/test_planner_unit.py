"""The planner's pure parts: the step-time model from trial records, predictions, the recommendation,
memory probing order, the table and the commands ``distaccum plan`` writes."""

from __future__ import annotations

import math

import pytest

from distaccum.cli.plan import train_command, user_overrides
from distaccum.config import Split
from distaccum.tuning.autobatch import Measurement
from distaccum.tuning.planner import (
    SplitPlan,
    interleave,
    predict,
    probe_sizes,
    recommend,
    render_table,
    size_cost,
    steady_steps,
    typical_step_s,
)

pytestmark = pytest.mark.unit


def record(step: int, data: float, compute: float, exposed: float, optim: float, **extra: object) -> dict:
    return {
        "step": step,
        "data_s": data,
        "compute_s": compute,
        "comm_exposed_s": exposed,
        "optim_s": optim,
        "time_s": data + compute + exposed + optim,
        "partial_window": False,
        **extra,
    }


def trial(k: int, micro: float, boundary: float, optim: float, jitter: list[float]) -> list[dict]:
    """Records of a trial at K=k whose phases add up as a real step's do."""
    return [
        record(i + 1, 0.1 * micro * k, 0.9 * micro * k + j, boundary, optim) for i, j in enumerate(jitter)
    ]


def test_cost_model_reproduces_the_trial_and_extrapolates_linearly_in_k() -> None:
    records = trial(
        4, micro=0.010, boundary=0.004, optim=0.002, jitter=[0.5, 0.0, 0.001, -0.001, 0.002, 0.0, 0.0]
    )
    cost = size_cost(records, micro_batch=2, trial_accum=4)
    assert math.isclose(cost.step_s(4), typical_step_s(records), rel_tol=1e-12)  # K_t: the trial itself
    assert cost.steps == 6  # the warm-up step dropped
    assert math.isclose(cost.step_s(16) - cost.step_s(4), 12 * cost.micro_s)
    assert math.isclose(cost.comm_share(1), cost.boundary_s / (cost.compute_s + cost.boundary_s))


def test_typical_step_drops_warmup_and_partial_windows_and_resists_stalls() -> None:
    records = [record(1, 0, 9.0, 0, 0)] + [record(i, 0, 1.0 + 0.01 * i, 0, 0) for i in range(2, 12)]
    records.append(record(12, 0, 0.5, 0, 0, partial_window=True))
    assert [r["step"] for r in steady_steps(records)] == list(range(2, 12))
    before = typical_step_s(records)
    records[5]["compute_s"] = records[5]["time_s"] = 50.0  # another process stalled this step
    assert abs(typical_step_s(records) - before) <= 0.011  # the median moves by at most one neighbour


def test_predictions_cover_every_split_and_recommend_the_fastest_that_fits() -> None:
    probes = [
        Measurement(1, 100, True),
        Measurement(2, 110, True),
        Measurement(4, 130, True),
        Measurement(8, 500, False),
    ]
    costs = [
        size_cost(
            trial(min(8 // m, 4), micro=0.002 + 0.001 * m, boundary=0.003, optim=0.001, jitter=[0.0] * 4),
            m,
            min(8 // m, 4),
        )
        for m in (1, 2, 4)
    ]
    preds = predict(16, 2, costs, probes)
    assert [(p.split.micro_batch, p.split.accum_steps) for p in preds] == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert preds[-1].step_s is None and not preds[-1].fits
    assert math.isclose(preds[0].step_s or 0, 8 * 0.003 + 0.004)  # K x micro + boundary + optim
    assert recommend(preds) == Split(4, 2, 2)  # 2 x 0.006 + 0.004 beats 4 x 0.004 + 0.004
    table = render_table(SplitPlan(16, 2, 200, "cpu peak rss", preds, costs, recommend(preds)))
    assert (
        "| w2-m4-k2 | 4 | 2 | 16.0 ms |" in table
        and "<- recommended" in table
        and "| w2-m8-k1 | 8 | 1 | - |" in table
    )
    again = SplitPlan.from_dict(
        SplitPlan(16, 2, 200, "cpu peak rss", preds, costs, recommend(preds)).as_dict()
    )
    assert again.recommended == Split(4, 2, 2) and again.predictions == preds


def test_memory_probes_stop_before_sizes_predicted_not_to_fit() -> None:
    tried: list[int] = []

    def measure(m: int) -> Measurement:
        tried.append(m)
        return Measurement(m, 100 + 10 * m, 100 + 10 * m <= 300)

    probes = probe_sizes([1, 2, 4, 8, 16, 32], measure, 300)
    assert tried == [1, 2, 4, 8, 16]  # 32 extrapolates to 420 > 300: never run
    assert [p.fits for p in probes] == [True, True, True, True, True, False] and not probes[-1].measured


def test_interleave_rotates_the_order_each_round() -> None:
    calls: list[str] = []
    interleave([lambda n, x=x: calls.append(f"{x}{n}") for x in "abc"], rounds=3, steps=2)
    assert calls == ["a2", "b2", "c2", "b2", "c2", "a2", "c2", "a2", "b2"]


def test_commands_replace_the_split_and_keep_the_rest() -> None:
    overrides = [
        "model=mlp",
        "accum.micro_batch=auto",
        "++accum.global_batch=7",
        "run_dir=x",
        "--config-dir",
        "conf",
    ]
    assert user_overrides(overrides) == ["model=mlp", "--config-dir", "conf"]
    assert train_command(overrides, 16, "1,2,4", "runs/s", multirun=True) == [
        "distaccum",
        "train",
        "--multirun",
        "model=mlp",
        "--config-dir",
        "conf",
        "accum.global_batch=16",
        "accum.micro_batch=1,2,4",
        "run_dir=runs/s",
    ]
