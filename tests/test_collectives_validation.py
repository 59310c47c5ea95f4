"""The validation harness of the α–β collectives model against gloo on this machine
(``python -m benchmarks.collectives``): α, β and γ fitted to ring reduce-scatters and all-gathers on 2
ranks, then the ring all-reduce, the rings at other sizes and all three on 4 ranks predicted and measured.

What this test asserts is the harness (every case measured in every round, validation sizes apart from
the calibration ones, every collective on 2 and 4 ranks predicted, a finite fit). How close the
predictions come (issue 22's 25 % bound) is a timing on a 2-core machine where 4 ranks share 2 cores:
on a quiet machine the same command has given a worst error of under 25 % in one run and +34 % in the
next, so it is not a pass/fail a test can hold deterministically. The benchmark judges it instead (exit
code 1 beyond 25 %) and docs/planning.md publishes its table with the errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.collectives import cases, cores, evaluate, measure, table

pytestmark = [pytest.mark.dist]

ROUNDS = 6


def test_the_harness_measures_fits_and_predicts_every_collective(tmp_path: Path) -> None:
    measured, _ = measure(ROUNDS, smoke=False, scratch=tmp_path, timeout_s=150)
    link, rows = evaluate(measured, cores())
    text = table(link, rows, f"{ROUNDS} rounds")
    print(text)
    validation = [r for r in rows if r.case.role == "validation"]
    assert len(rows) == len(cases()) and all(len(m["times"]) == ROUNDS for m in measured)
    assert {(r.case.op, r.case.world) for r in validation} == {
        (op, w) for op in ("all_reduce", "reduce_scatter", "all_gather") for w in (2, 4)
    }
    assert not {r.case.n_bytes for r in validation if r.case.world == 2} & {
        r.case.n_bytes for r in rows if r.case.role == "calibration"
    }, "validation sizes must be new ones"
    assert (
        link.alpha_s > 0
        and link.beta_bytes_per_s > 0
        and all(r.predicted_s > 0 and r.measured_s > 0 for r in rows)
    )
