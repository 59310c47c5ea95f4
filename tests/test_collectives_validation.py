"""The α–β model of the collectives against gloo on this machine (``python -m benchmarks.collectives``):
α, β and γ fitted to ring reduce-scatters and all-gathers on 2 ranks predict the ring all-reduce, the
rings at other sizes, and all three on 4 ranks, each within 25 % of its measured time (issue 22). The model gives
the ranks the machine's cores; when other programs' processes were runnable while it measured (a shared
developer machine), the timings say nothing about it and the test skips, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.collectives import QUIET, busy, cases, cores, evaluate, measure, table

pytestmark = [pytest.mark.dist, pytest.mark.serial]  # predicted against measured collective times

ROUNDS = 6


def test_the_model_predicts_measured_collectives_within_25_percent(tmp_path: Path) -> None:
    measured, _ = measure(ROUNDS, smoke=False, scratch=tmp_path, timeout_s=150)
    link, rows = evaluate(measured, cores())
    text = table(link, rows, f"{ROUNDS} rounds")
    print(text)
    validation = [r for r in rows if r.case.role == "validation"]
    assert len(rows) == len(cases()) and all(len(m["times"]) == ROUNDS for m in measured)
    assert {(r.case.op, r.case.world) for r in validation} == {
        (op, w) for op in ("all_reduce", "reduce_scatter", "all_gather") for w in (2, 4)}
    assert not {r.case.n_bytes for r in validation if r.case.world == 2} & {
        r.case.n_bytes for r in rows if r.case.role == "calibration"}, "validation sizes must be new ones"
    if busy(rows) > QUIET:  # another program's processes took cores the model gives the ranks (CI runs this alone)
        pytest.skip(f"the machine was shared ({busy(rows):g} other runnable processes on median): timings not judged\n"
                    + text)
    worst = max(validation, key=lambda r: abs(r.error))
    assert abs(worst.error) <= 0.25, f"{worst.case} predicted {worst.error:+.1%} off:\n{text}"
