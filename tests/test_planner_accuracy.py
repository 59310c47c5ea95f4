"""The plan's predictions against the real splits, measured in the same two processes.

``tests/fixtures/plan_vs_real.py`` runs the planner's trials (K <= 2) and real training of every split
of a 32-sample global batch of a 4.2M-parameter MLP on two gloo ranks, each size's trial next to
its real split, one step at a time, 12 rounds. Three of the five splits (K = 4, 8, 16) are not
measured by any trial: the plan extrapolates them from K = 2 (up to 8x), and they are held to the
same bound as the two it measured directly. The splits differ by 3-4x (one sample per
micro-batch reads every weight for one sample), far more than the noise of a shared two-core machine
(identical configurations measured side by side differed by up to 8% under a load average of 6, and one
size's trial and its real split, the same configuration, by 13% in one CI run). The recommendation is
the fastest prediction; its measured rank is not asserted (two splits predicted 2.4% apart measured 24%
apart in one CI run).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import REPO, torchrun

# Predicted against measured step times: on a quiet machine (make stress), not in CI, where the suite's own load moved
# an extrapolated split's measurement by 41% against its prediction in one run (issue 55).
pytestmark = [pytest.mark.dist, pytest.mark.serial, pytest.mark.timing]


def test_predicted_step_times_match_the_real_splits(tmp_path: Path) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "plan_vs_real.json"
    proc = torchrun(
        str(REPO / "tests" / "fixtures" / "plan_vs_real.py"),
        str(out),
        str(tmp_path / "runs"),
        env=env,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    table = "\n".join(
        f"{r['split']}: predicted {r['predicted_s'] * 1e3:.1f} ms "
        f"({'extrapolated from K=' + str(r['trial_accum']) if r['accum_steps'] > r['trial_accum'] else 'its own trial'}),"
        f" measured {r['measured_s'] * 1e3:.1f} ms ({r['predicted_s'] / r['measured_s'] - 1:+.1%})"
        for r in rows
    )
    print(table)
    measured = {r["split"]: r["measured_s"] for r in rows}
    assert len(rows) == 5 and all(r["steps"] == 12 for r in rows)
    extrapolated = sorted(
        r["accum_steps"] // r["trial_accum"] for r in rows if r["accum_steps"] > r["trial_accum"]
    )
    assert extrapolated == [2, 4, 8], f"the plan must extrapolate K = 4, 8, 16 from trials at K = 2:\n{table}"
    assert max(measured.values()) >= 2 * min(measured.values()), f"splits too alike to test a plan:\n{table}"
    for r in rows:
        assert abs(r["predicted_s"] / r["measured_s"] - 1) <= 0.20, (
            f"{r['split']} off by more than 20%:\n{table}"
        )
    # Which split the plan recommends is min() over these predictions; whether that choice is the fastest
    # depends on the measured order of the top splits, which on CI's shared machine is a coin toss when
    # they are predicted within a few percent of each other (m8-k2 predicted 2.4% faster than m16-k1 measured
    # 24% slower in one CI run). A timing cannot assert that order, only the 20% above.
    assert result["recommended"] == min(rows, key=lambda r: r["predicted_s"])["split"], table
