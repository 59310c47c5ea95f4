"""``distaccum plan`` for a growing batch (unit tier): each phase's K and predicted step time from the measured
coefficients of the planner's step-time model, the adaptive batch's bounds, sizes that were not measured."""

from __future__ import annotations

import pytest

from distaccum.batching.growth import BatchGrowth
from distaccum.split import Split
from distaccum.tuning.growth_plan import phase_rows, render_phases
from distaccum.tuning.planner import SizeCost

pytestmark = pytest.mark.unit


def cost(micro: int, base_s: float, micro_s: float) -> SizeCost:
    """A step at K = 2 takes ``base_s``; every further micro-batch ``micro_s``."""
    return SizeCost(micro, 2, 10, base_s, micro_s, micro_s * 0.9, 0.01, 0.005)


COSTS = [cost(4, 0.10, 0.04), cost(2, 0.06, 0.02)]


def test_each_phase_takes_its_k_and_the_model_s_step_time() -> None:
    schedule = BatchGrowth([(0, 8), (5, 16), (10, 32)])
    rows = phase_rows(schedule.phases, COSTS, 4, 2, 12)
    assert [(r.first, r.last, r.split) for r in rows] == [
        (1, 5, Split(4, 1, 2)),
        (6, 10, Split(4, 2, 2)),
        (11, 12, Split(4, 4, 2)),
    ]
    assert [r.step_s for r in rows] == pytest.approx([0.06, 0.10, 0.18])  # 0.10 + (K - 2) x 0.04
    assert rows[2].phase_s == pytest.approx(0.36) and rows[0].samples_per_s == pytest.approx(8 / 0.06)
    text = render_phases(schedule, COSTS, 4, 2, 12)
    assert "| 11-12 | 32 | w2-m4-k4 (K=4) | 180.0 ms | 178 | 360.0 ms |" in text
    assert (
        "whole ramp, 12 steps, 184 samples: predicted 1.2 s of steps" in text
    )  # 5x8+5x16+2x32; 0.3+0.5+0.36


def test_a_lowered_micro_batch_uses_its_own_size_or_says_it_was_not_measured() -> None:
    rows = phase_rows([(0, 4), (2, 16)], COSTS, 4, 2, 4)
    assert rows[0].split == Split(2, 1, 2) and rows[0].step_s == pytest.approx(0.04)  # measured size 2
    unmeasured = phase_rows([(0, 6), (2, 16)], COSTS, 4, 2, 4)
    assert unmeasured[0].split == Split(3, 1, 2) and unmeasured[0].step_s is None
    text = render_phases(BatchGrowth([(0, 6), (2, 16)]), COSTS, 4, 2, 4)
    assert "not measured" in text and "whole ramp" not in text


def test_the_adaptive_batch_shows_its_start_and_bounds() -> None:
    text = render_phases(BatchGrowth.constant(16), COSTS, 4, 2, 100, adaptive_bounds=(8, 64))
    assert "from 16 within [8, 64]" in text
    assert (
        "| 8 | w2-m4-k1 (K=1) | 60.0 ms | 133 |" in text
        and "| 64 | w2-m4-k8 (K=8) | 340.0 ms | 188 |" in text
    )
