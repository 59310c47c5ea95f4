"""The benchmark harness's arithmetic, bookkeeping and rendering, in-process (no launches, no timings)."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks import report
from benchmarks.cases import FULL_CASES, GPU_CASES, SMOKE_CASES, BenchData, Spec, launch_spec, loss_sum
from benchmarks.launch import ROOT, Launch
from benchmarks.run import BUDGET_S
from benchmarks.run import main as run_main
from benchmarks.stats import (
    COMPILED,
    GUARD,
    faster_compiled_expert,
    guard,
    interval_rank,
    median_interval,
    per_round_ratios,
    spread,
    summarize_launch,
    verdict,
)
from benchmarks.variants import (
    DISTACCUM,
    HAND_WRITTEN,
    SWEPT,
    TIMED,
    build_variant,
    check_variants,
    distaccum_config,
)
from benchmarks.workers import reference_of, round_order
from distaccum.config import RunConfig, from_mapping, to_mapping
from distaccum.data.pipeline import OrderSampler
from distaccum.telemetry.ledger import HostClock

pytestmark = pytest.mark.unit


# -- statistics ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_the_round_order_balances_positions_and_predecessors(n: int) -> None:
    order = [f"v{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n
    rounds = [round_order(order, r) for r in range(cycle)]
    assert rounds[0] == round_order(order, cycle) and all(sorted(r) == order for r in rounds)
    for position in range(n):  # every variant in every position equally often
        counts = Counter(r[position] for r in rounds)
        assert set(counts.values()) == {cycle // n} and len(counts) == n
    pairs = Counter((a, b) for r in rounds for a, b in zip(r, r[1:], strict=False))
    assert (
        len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    )  # every variant after every other alike


def test_spread_uses_inclusive_quartiles() -> None:
    s = spread([8.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    assert (s.median, s.min, s.max, s.q1, s.q3, s.rounds) == (4.5, 1.0, 8.0, 2.75, 6.25, 8)
    assert (s.ci_low, s.ci_high) == (1.0, 8.0)  # 8 rounds: the median's 95 % interval is min-max
    assert spread([2.0]).q1 == spread([2.0]).q3 == 2.0
    with pytest.raises(ValueError):
        spread([])


def test_per_round_ratios_cancel_drift_that_falls_on_both_variants() -> None:
    drift = [1.0, 1.3, 0.8, 1.5, 1.1, 0.9]  # the machine slows down and speeds up between rounds
    slow, fast = [1.05 * d for d in drift], [1.0 * d for d in drift]
    ratios = per_round_ratios(slow, fast)
    assert spread(ratios).max - spread(ratios).min < 1e-12
    assert spread(slow).max / spread(slow).min > 1.8  # the raw times move by 80 %
    with pytest.raises(ValueError):
        per_round_ratios([1.0], [1.0, 2.0])


@pytest.mark.parametrize("n", [1, 5, 6, 8, 12, 24, 40, 60, 200])
def test_the_median_interval_holds_95_percent_by_the_binomial(n: int) -> None:
    """x_(j) <= median <= x_(n+1-j) has probability 1 - 2 P(B <= j-1), B ~ Binomial(n, 1/2): the rank is the
    largest whose coverage reaches 95 % (min-max where none does), computed here independently."""

    def coverage(j: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(j)) / 2**n

    j = interval_rank(n)
    assert 1 <= j <= (n + 1) // 2
    assert j == 1 or coverage(j) >= 0.95
    assert coverage(j + 1) < 0.95 or j + 1 > (n + 1) // 2 or n <= 2
    assert {6: 1, 8: 1, 12: 3, 24: 7, 60: 22}.get(n, j) == j
    values = [float(v) for v in range(n, 0, -1)]
    assert median_interval(values) == (float(j), float(n + 1 - j))


def test_the_median_interval_narrows_with_rounds_where_the_quartiles_do_not() -> None:
    pattern = [0.94, 0.97, 0.99, 1.00, 1.01, 1.03, 1.06, 1.00]
    few, many = spread(pattern), spread(pattern * 10)
    assert (few.q1, few.q3) == pytest.approx((many.q1, many.q3), abs=0.011)
    assert few.ci_high - few.ci_low > 0.1 and many.ci_high - many.ci_low <= 0.02


def test_verdict_reads_the_median_s_interval() -> None:
    assert verdict(spread([1.00, 1.01, 1.01, 1.015]), 1.02) == "met"
    assert verdict(spread([1.00, 1.01, 1.03, 1.04]), 1.02) == "not resolved"
    assert verdict(spread([1.021, 1.05, 1.06, 1.07]), 1.02) == "missed"
    assert verdict(spread([1.5]), None) == ""
    scatter = [0.96, 0.98, 1.00, 1.00, 1.01, 1.02, 1.04, 1.06]
    assert verdict(spread(scatter), 1.02) == "not resolved"
    assert verdict(spread(scatter * 8), 1.02) == "met"  # 64 rounds: x_(24)..x_(41) = 1.00..1.02


BASE = {
    "ddp_no_sync": 1.0,
    "distaccum": 1.01,
    "compute_floor": 0.9,
    "ddp_no_sync_twin": 1.0,
    "distaccum_compiled": 1.03,
    "ddp_no_sync_compiled": 1.05,
    "ddp_no_sync_compiled_static": 1.02,
    "ddp_no_sync_compiled_twin": 1.05,
}


def _timing_record(case: str = "27.3M_micro4", k: int = 4, rounds: int = 8, **scale: float) -> dict[str, Any]:
    """A launch's record as rank 0 writes it: every variant's block times, round by round (the machine drifts)."""
    names = list(BASE)
    spec = dataclasses.replace(
        launch_spec(SMOKE_CASES[0], k, steps=2, rounds=rounds, variants=tuple(names)), case=case
    )
    base = {**BASE, **scale}
    return {
        "spec": json.loads(spec.to_json()),
        "orders": [round_order(names, r) for r in range(rounds)],
        "step_s": {n: [[base[n] * (1 + 0.1 * r)] * spec.steps for r in range(rounds)] for n in names},
        "param_rel_diff": {n: 0.0 for n in names} | {"distaccum": 2e-8, "compute_floor": 3e-3},
        "param_reference": "ddp_no_sync",
    }


def test_summarize_launch_takes_ratios_round_by_round() -> None:
    row = summarize_launch(_timing_record())
    ratio = row["ratios"]["distaccum / expert"]
    assert ratio["median"] == pytest.approx(1.01) and ratio["rounds"] == 8 and len(ratio["per_round"]) == 8
    assert ratio["target"] == 1.02 and ratio["verdict"] == "met" and ratio["denominator"] == "ddp_no_sync"
    assert row["ratios"]["A/A: expert twin / expert"]["median"] == pytest.approx(1.0)
    assert row["variants"]["distaccum"]["step_s"]["max"] == pytest.approx(1.01 * 1.7)
    assert "Accelerate / expert" not in row["ratios"]  # only ratios whose two variants ran


def test_compiled_distaccum_is_judged_against_the_faster_compiled_expert_loop() -> None:
    static_faster = summarize_launch(_timing_record())["ratios"][COMPILED]
    assert static_faster["denominator"] == "ddp_no_sync_compiled_static"
    assert static_faster["median"] == pytest.approx(1.03 / 1.02)
    dynamic_faster = summarize_launch(_timing_record(ddp_no_sync_compiled=0.99))["ratios"][COMPILED]
    assert dynamic_faster["denominator"] == "ddp_no_sync_compiled" and dynamic_faster["verdict"] == "missed"
    assert faster_compiled_expert({"ddp_no_sync_compiled": [2.0]}) == "ddp_no_sync_compiled"
    assert faster_compiled_expert({"distaccum": [1.0]}) is None


def test_the_guard_is_the_worst_split_s_median() -> None:
    rows = [summarize_launch(_timing_record(k=k, distaccum=d)) for k, d in ((1, 1.01), (4, 1.04), (16, 1.02))]
    assert guard(rows) == {
        "bound": GUARD,
        "met": True,
        "worst": pytest.approx(1.04),
        "case": "27.3M_micro4",
        "k": 4,
        "splits": 3,
    }
    rows.append(summarize_launch(_timing_record(k=8, distaccum=1.06)))
    assert guard(rows)["met"] is False and guard(rows)["k"] == 8
    assert guard([]) is None


def test_a_run_without_the_expert_loop_compares_parameters_with_its_first_hand_written_loop() -> None:
    assert reference_of(["distaccum", "ddp_no_sync_compiled", "ddp_no_sync"]) == "ddp_no_sync"
    assert reference_of(["ddp_no_sync_compiled", "distaccum_compiled"]) == "ddp_no_sync_compiled"
    assert reference_of(["compute_floor", "distaccum"]) is None  # the floor must differ: never the reference


# -- results, the stored files and the page ------------------------------------------------------------------------


META = {
    "commit": "0123456789ab",
    "uncommitted_changes": False,
    "source_sha256": "feedfacecafe",
    "date": "2026-11-28",
    "command": "python -m benchmarks.run --out runs/bench",
    "torch": "2.13.0+cpu",
    "python": "3.11.7",
    "accelerate": "1.15.0",
    "deepspeed": "0.19.8",
    "platform": "linux",
    "cpu": "AMD EPYC",
    "logical_cpus": 2,
    "threads": "1 intra-op thread per rank",
    "world_size": 2,
    "device": "cpu",
    "device_name": "cpu",
    "backend": "gloo",
    "precision": "fp32",
}


def _ops(k: int) -> dict[str, Any]:
    return {
        "k": k,
        "expert": {"ops": 4 * k + 8, "names": {"aten::div": k, "aten::slice": 2 * k}},
        "distaccum": {"ops": 4 * k + 14, "names": {"aten::mul": k, "aten::slice": 2 * k, "aten::stack": 2}},
    }


def _results(device: str = "cpu", smoke: bool = False) -> dict[str, Any]:
    """A whole run's results.json: every full case and K timed, the memory sweep at K = 1 and 16, the op counts."""
    timing = []
    for case in FULL_CASES:
        for k in case.ks:
            row = summarize_launch(_timing_record(case.name, k))
            row.update(
                {"status": "ok", "launch": {"ok": True, "wall_s": 9.0, "load_1m": [1.5, 2.1], "error": ""}}
            )
            timing.append(row)
    memory = [
        {
            "case": case.name,
            "k": k,
            "variant": variant,
            "sync": "auto",
            "status": "ok",
            "step_s": spread([0.01, 0.012]).as_dict(),
            "step_peak_mb": peak,
            "process_peak_mb": peak + 10,
            "setup_peak_mb": 300.0,
            "records": {"comm_rounds": 1.0, "comm_bytes": 7e6},
            "launch": {"ok": True, "wall_s": 9.0, "load_1m": [1.5, 2.1], "error": ""},
        }
        for case in FULL_CASES
        for k in case.sweep_ks
        for variant, peak in (
            ("distaccum", 500.0 if k == 1 else 505.0),
            ("distaccum_fsdp", 400.0 if k == 1 else 450.0),
        )
    ]
    cases = {
        c.name: {"about": c.about, "params": c.shape.num_params(), "micro_batch": c.micro_batch}
        for c in FULL_CASES
    }
    return {
        "meta": {**META, "device": device},
        "settings": {
            "smoke": smoke,
            "rounds": 100000,
            "budget_s": BUDGET_S,
            "block_steps": 1,
            "sweep_env": {},
        },
        "cases": cases,
        "finished": True,
        "wall_s": 1.0,
        "timing": timing,
        "memory": memory,
        "host_ops": {"1": _ops(1), "16": _ops(16)},
    }


def test_a_run_is_stored_as_one_file_per_part_each_with_the_code_and_environment() -> None:
    parts = report.parts_of(_results())
    assert set(parts) == {"cpu-timing.json", "cpu-memory.json", "host-ops.json"}
    assert all(stored["meta"] == META for stored in parts.values())
    assert "orders" not in parts["cpu-timing.json"]["timing"][0]  # runs/ keeps them
    assert set(report.parts_of(_results(device="cuda"))) == {
        "gpu-timing.json",
        "gpu-memory.json",
        "host-ops.json",
    }
    assert all(report.problems(stored) == [] for stored in parts.values())


def test_storing_refuses_what_must_not_become_a_figure() -> None:
    def refused(results: dict[str, Any], part: str = "cpu-timing.json", **allow: bool) -> str:
        return "; ".join(report.problems(report.parts_of(results)[part], **allow))

    assert "smoke" in refused(_results(smoke=True))
    partial = _results()
    partial["timing"] = partial["timing"][:-1]
    partial["host_ops"] = {"1": _ops(1)}
    assert "partial" in refused(partial) and "host ops K=16" in refused(partial, "host-ops.json")
    assert refused(partial, allow_partial=True) == ""
    few = _results()
    few["timing"][0]["rounds"] = 5
    assert "5 rounds" in refused(few)
    failed = _results()
    failed["memory"][0]["status"] = "failed"
    assert "failed launches: memory" in refused(failed, "cpu-memory.json")
    assert refused(failed, "cpu-memory.json", allow_partial=True) == ""
    loaded = _results()
    for row in loaded["timing"]:
        row["launch"]["load_1m"] = [6.0, 7.5]
    assert "shared" in refused(loaded) and refused(loaded, allow_loaded=True) == ""
    stopped = {**_results(), "finished": False}
    assert "stopped part-way" in refused(stopped)


def test_the_tables_show_what_ran_where_and_every_column() -> None:
    parts = report.parts_of(_results())
    text = report.section_body("cpu-timing", parts)
    for fragment in (
        "commit `0123456789ab`",
        "sources sha256 `feedfacecafe`",
        "torch 2.13.0+cpu",
        "AMD EPYC, 2 logical CPUs",
        "world 2, 1 intra-op thread per rank",
        "Stored: `docs/results/cpu-timing.json`",
        "| 27.3M_micro4 (27.3M params, micro-batch 4) | 1 | 8 | 1.010 (1.010-1.010) |",
        "1.010 (1.010-1.010) vs static",
        "blocks of 1 optimizer step(s) per variant, whole cycles of rounds",
        "Same work:",
        "distaccum 2.0e-08",
        "The compute floor, which averages nothing over ranks, differs by 3.0e-03",
        "Regression guard (median of distaccum / expert <= 1.05 at every split, this run as "
        "measured): met; the largest median is 1.010",
        "12 met of 12",
    ):
        assert fragment in text, fragment
    memory = report.section_body("cpu-memory", parts)
    assert "| distaccum | ddp | auto | 500 -> 505 | 1.010 |" in memory and "| 400 -> 450 | 1.125 |" in memory
    assert "**no**" in memory and "peak RSS" in memory
    ops = report.section_body("host-ops", parts)
    assert "| 16 | 72 | 78 | +6 |" in ops and "+0 operators per micro-batch, +6 per step" in ops
    targets = report.section_body("targets", parts)
    assert (
        "| distaccum / expert <= 1.02 | CPU |" in targets
        and "grows: 27.3M_micro4 distaccum_fsdp 1.125" in targets
    )
    assert "| guard: distaccum / expert median <= 1.05 at every split | CPU | largest 1.010" in targets


def test_a_part_never_stored_says_it_was_not_measured_and_how_to_measure_it() -> None:
    assert "Not measured for this release yet: run `make bench`" in report.section_body("cpu-timing", {})
    assert "No GPU was lent for this release" in report.section_body("gpu-timing", {})
    assert "`benchmarks/gpu_check.sh OUT`" in report.section_body("gpu-memory", {})


def test_the_page_is_the_render_of_the_stored_results() -> None:
    """BENCHMARKS.md's generated sections are exactly what ``python -m benchmarks.report`` renders from
    docs/results/: a figure edited by hand, or a stored result not rendered, fails here."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert report.render_doc(text, report.load_store(report.STORE)) == text, (
        "run `python -m benchmarks.report`"
    )
    assert all(report.markers(section)[0] in text for section in report.SECTIONS)
    assert len(text.splitlines()) <= 300


def test_rendering_replaces_only_the_generated_sections() -> None:
    begin, end = report.markers("cpu-timing")
    doc = f"# B\n\nprose above\n\n{begin}\n\nold figures\n\n{end}\n\nprose below\n"
    assert (
        report.replace_section(doc, "cpu-timing", "new")
        == f"# B\n\nprose above\n\n{begin}\n\nnew\n\n{end}\n\nprose below\n"
    )
    with pytest.raises(ValueError, match="bench:gpu-timing"):
        report.replace_section(doc, "gpu-timing", "x")


def test_make_bench_docs_stores_a_run_and_renders_the_page_from_it(tmp_path: Path) -> None:
    """``python -m benchmarks.report --store`` end to end on a copy of BENCHMARKS.md: every section filled from the
    stored files, the page then in sync (``--check``); a refused run stores nothing in docs/results."""
    results, doc, store = tmp_path / "results.json", tmp_path / "BENCHMARKS.md", tmp_path / "stored"
    results.write_text(json.dumps(_results()))
    doc.write_text((ROOT / "BENCHMARKS.md").read_text())
    assert report.main(["--store", str(results), "--results-dir", str(store), "--doc", str(doc)]) == 0
    assert sorted(p.name for p in store.iterdir()) == ["cpu-memory.json", "cpu-timing.json", "host-ops.json"]
    text = doc.read_text()
    assert "Not measured for this release yet" not in text and "No GPU was lent" in text
    assert f"Stored: `{store}/cpu-timing.json`" in text
    assert report.main(["--check", "--results-dir", str(store), "--doc", str(doc)]) == 0
    doc.write_text(text.replace("1.010 (1.010-1.010)", "0.990 (0.980-1.000)", 1))
    assert report.main(["--check", "--results-dir", str(store), "--doc", str(doc)]) == 1
    results.write_text(json.dumps(_results(smoke=True)))
    assert (
        report.main(["--store", str(results), "--doc", str(doc), "--check"]) == 1
    )  # refused for docs/results
    assert report.main(["--store", str(tmp_path / "missing.json"), "--doc", str(doc)]) == 2


def test_the_hsdp_table_goes_into_its_section(tmp_path: Path) -> None:
    results = _results()
    results["memory"] = [
        {
            **row,
            "variant": variant,
            "records": {
                "comm_rounds": 1.0,
                "comm_calls": 8.0,
                "comm_bytes": 2**20,
                "comm_rounds_replicate": 1.0,
                "comm_calls_replicate": 8.0,
                "comm_bytes_replicate": 2**19,
            },
        }
        for row in results["memory"][:4]
        for variant in ("distaccum_hsdp_replica_boundary",)
    ]
    path, doc = tmp_path / "hsdp.json", tmp_path / "multinode.md"
    path.write_text(json.dumps(results))
    begin, end = report.markers("hsdp")
    doc.write_text(f"# M\n\n{begin}\n\nold\n\n{end}\n")
    assert report.main(["--hsdp", str(path), "--doc", str(doc)]) == 0
    assert (
        "| HSDP, replica_boundary (default) | 16 | 1 / 8 / 1.0 MiB | 1 / 8 / 512.0 KiB |" in doc.read_text()
    )


# -- the run's options ---------------------------------------------------------------------------------------------


class Launches:
    """Stands for :func:`benchmarks.launch.launch` in :mod:`benchmarks.run`: records (mode, spec) of every launch and
    what results.json held when it started, and fails at once (nothing runs)."""

    def __init__(self, out: Path) -> None:
        self.out, self.calls, self.seen = out, [], []

    def __call__(
        self,
        module: str,
        args: list[str],
        world: int,
        log: Path,
        timeout_s: float,
        env: dict[str, str] | None = None,
    ) -> Launch:
        self.calls.append((args[0], Spec.from_json(args[1])))
        on_disk = self.out / "results.json"
        self.seen.append(json.loads(on_disk.read_text()) if on_disk.exists() else None)
        return Launch(False, [1] * world, 0.1, 1.0, (0.0, 0.0), "failed on purpose")


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Launches:
    import benchmarks.run as bench_run

    launches = Launches(tmp_path)
    monkeypatch.setattr(bench_run, "launch", launches)
    return launches


def test_make_bench_times_every_split_step_by_step_for_a_time_budget(
    tmp_path: Path, launched: Launches
) -> None:
    """The defaults: every full case and K with ``TIMED`` in one-step blocks for ``BUDGET_S`` seconds of whole cycles,
    then ``SWEPT`` at K = 1 and 16 in fresh processes; the GPU case is not run on a CPU."""
    assert run_main(["--device", "cpu", "--ops", "none", "--out", str(tmp_path)]) == 1
    timing = [spec for mode, spec in launched.calls if mode == "timing"]
    memory = [spec for mode, spec in launched.calls if mode == "memory"]
    assert [(s.case, s.accum_steps) for s in timing] == [(c.name, k) for c in FULL_CASES for k in c.ks]
    assert all((s.steps, s.budget_s, s.rounds, s.variants) == (1, BUDGET_S, 100_000, TIMED) for s in timing)
    assert [(s.case, s.accum_steps, s.variants) for s in memory] == [
        (c.name, k, (v,)) for c in FULL_CASES for k in c.sweep_ks for v in SWEPT
    ]
    results = json.loads((tmp_path / "results.json").read_text())
    assert (
        results["finished"] is True
        and results["meta"]["world_size"] == 2
        and results["meta"]["device"] == "cpu"
    )
    assert [r["status"] for r in results["timing"]] == ["failed"] * len(timing)


def test_a_run_keeps_each_launch_on_disk_as_it_finishes(tmp_path: Path, launched: Launches) -> None:
    """A run stopped part-way (a lease that ends, a timeout) keeps the launches it finished: results.json is
    rewritten after each one, ``finished`` false until the end."""
    assert (
        run_main(["--smoke", "--sweep", "none", "--ops", "none", "--device", "cpu", "--out", str(tmp_path)])
        == 1
    )
    seen = launched.seen
    assert seen[0] is None and seen[1]["finished"] is False
    assert [(r["case"], r["k"], r["status"]) for r in seen[1]["timing"]] == [("smoke", 1, "failed")]
    final = json.loads((tmp_path / "results.json").read_text())
    assert final["finished"] is True and len(final["timing"]) == 2
    assert "Smoke run" in (tmp_path / "results.md").read_text()


def test_bad_options_are_refused_before_any_launch(
    tmp_path: Path, launched: Launches, capsys: pytest.CaptureFixture[str]
) -> None:
    for bad, said in (
        (["--cases", "27.3M_micro4,nope"], "no case nope"),
        (["--variants", "horovod"], "horovod"),
        (["--block-steps", "0"], "at least 1"),
        (["--rounds", "0"], "at least 1"),
        (["--variants", "accelerate,distaccum_accelerate"], "singleton"),
    ):
        assert run_main([*bad, "--device", "cpu", "--out", str(tmp_path)]) == 2
        assert said in capsys.readouterr().err
    assert launched.calls == []
    assert "210M_micro1024" in {c.name for c in GPU_CASES}


# -- cases and variants --------------------------------------------------------------------------------------------


def test_cases_have_the_issue_sizes() -> None:
    params = {c.name: c.shape.num_params() for c in FULL_CASES}
    assert round(params["27.3M_micro4"] / 1e6, 1) == 27.3 and round(params["0.9M_micro256"] / 1e6, 1) == 0.9
    for case in (*FULL_CASES, *SMOKE_CASES, *GPU_CASES):
        with torch.device("meta"):
            model = case.shape.build()
        assert sum(p.numel() for p in model.parameters()) == case.shape.num_params()
    assert all(c.ks == (1, 4, 16) and c.sweep_ks == (1, 16) for c in FULL_CASES)


def test_spec_round_trips_through_json() -> None:
    spec = launch_spec(FULL_CASES[0], 16, steps=1, rounds=8, variants=TIMED, budget_s=BUDGET_S)
    assert Spec.from_json(spec.to_json()) == spec
    assert (spec.steps, spec.warmup, spec.total_steps) == (1, 2, 2 + 8)
    with pytest.raises(ValueError):
        launch_spec(FULL_CASES[0], 1, steps=0)


def test_every_distaccum_variant_is_a_valid_configuration(tmp_path: Path) -> None:
    """Variants are configurations: each one's overrides are fields the config knows, with values it accepts."""
    spec = launch_spec(FULL_CASES[1], 4, steps=1)
    for name, setup in DISTACCUM.items():
        cfg = to_mapping(from_mapping(distaccum_config(spec, tmp_path, setup)))
        for dotted, value in setup.overrides.items():
            section, key = dotted.split(".")
            assert cfg[section][key] == value, name
        assert cfg["engine"]["name"] == setup.engine, name
    check_variants(list(TIMED))
    check_variants(list(SWEPT[1:]))


def test_the_distaccum_variant_changes_only_the_documented_settings(tmp_path: Path) -> None:
    cfg = to_mapping(
        from_mapping(distaccum_config(launch_spec(FULL_CASES[1], 4, steps=1, rounds=8), tmp_path))
    )
    default = to_mapping(RunConfig())
    changed = {
        f"{section}.{key}"
        for section, values in cfg.items()
        if isinstance(values, dict)
        for key, value in values.items()
        if default[section][key] != value
    }
    assert changed == {
        "accum.micro_batch",
        "optim.schedule",
        "optim.warmup_steps",
        "optim.clip_norm",
        "trainer.max_steps",
        "trainer.device",
        "trainer.check_every",
        "trainer.checkpoint_every",
        "trainer.save_final",
        "data.shuffle",
        "log.console",
        "log.warmup_steps",
        "log.grad_norm",
    }
    assert (
        cfg["log"]["ledger"] is True
        and cfg["trainer"]["fingerprint"] is True
        and cfg["engine"]["name"] == "ddp"
    )


def test_the_harness_patches_nothing_of_the_library_and_stays_small() -> None:
    """benchmarks/ builds its variants from configs and Trainer arguments: no assignment to an attribute of anything
    imported from distaccum, no private name imported from it, no setattr or monkeypatching; and the timing harness
    holds at most 12 files beside the named studies that publish one docs page's figure each."""
    files = [p for p in (ROOT / "benchmarks").iterdir() if p.name != "__pycache__"]
    studies = {
        "outer_curves.py": "docs/outer.md",
        "batch_growth.py": "docs/planning.md",
        "checksum_margin.py": "docs/verification.md",
        "ft_cost.py": "docs/failures.md",
        "exact_price.py": "docs/verification.md",  # and its table in BENCHMARKS.md
    }
    harness = [p for p in files if p.name not in studies]
    assert len(harness) <= 12, sorted(p.name for p in harness)
    for path in (p for p in files if p.suffix == ".py"):
        tree = ast.parse(path.read_text())
        library = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distaccum")
            for alias in node.names
        }
        library |= {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("distaccum")
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distaccum"):
                assert not any(a.name.startswith("_") for a in node.names), (path.name, ast.dump(node))
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                assert not (isinstance(root, ast.Name) and root.id in library), (path.name, node.lineno)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "setattr", (path.name, node.lineno)
        assert "monkeypatch" not in path.read_text(), path.name


def test_distaccum_s_loss_over_the_global_count_is_the_hand_written_mean() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    micro = [(torch.randn(5, 3), torch.randn(5, 4)) for _ in range(3)]  # K=3 on one rank
    with torch.no_grad():
        hand = sum(F.mse_loss(model(x), y) / len(micro) for x, y in micro)
        sums, counts = zip(*(loss_sum(model, b) for b in micro), strict=True)
    assert float(sum(sums) / sum(counts)) == pytest.approx(float(hand), rel=1e-6)


@pytest.mark.parametrize("rank", [0, 1])
def test_hand_written_loops_see_the_trainer_s_micro_batches_as_views(rank: int) -> None:
    spec = launch_spec(SMOKE_CASES[0], 2, steps=1)
    data = BenchData(spec, world_size=2)
    order = data.order()
    sampler = OrderSampler(order, data.split, rank, 0, order.windows_per_epoch)  # what the Trainer walks
    for (x, y), indices in zip((b for w in data.windows(rank) for b in w), sampler, strict=True):
        assert torch.equal(x, data.x[indices]) and torch.equal(y, data.y[indices])
        assert x.untyped_storage().data_ptr() == data.x.untyped_storage().data_ptr()  # a view, no copy


@pytest.mark.parametrize("name", ["ddp_no_sync", "ddp_every_micro"])
def test_the_hand_written_ddp_loops_use_an_expert_s_settings(cpu_group: None, name: str) -> None:
    """Gradients as DDP bucket views, zeroed in place: the same gradient storage serves every window."""
    spec = launch_spec(SMOKE_CASES[0], 2, steps=1)
    loop = HAND_WRITTEN[name](name, spec, BenchData(spec, world_size=1), 0, torch.device("cpu"), HostClock())
    assert loop.ddp.gradient_as_bucket_view is True  # type: ignore[attr-defined]
    loop.run(2)  # DDP rebuilds its buckets once, after the first iteration
    storages = [p.grad.untyped_storage().data_ptr() for p in loop.model.parameters()]
    assert all(p.grad is not None and not p.grad.any() for p in loop.model.parameters())  # zeroed, kept
    loop.run(2)
    assert [p.grad.untyped_storage().data_ptr() for p in loop.model.parameters()] == storages


def test_the_variants_train_the_same_arithmetic_as_distaccum(cpu_group: None, tmp_path: Path) -> None:
    """The expert loop, its twin, the every-micro-batch loop and distaccum (and distaccum with its per-step checks
    off) train the same parameters from the same data; the twin bit for bit."""
    spec = launch_spec(SMOKE_CASES[0], 2, steps=1, rounds=3)
    data = BenchData(spec, world_size=1)
    trained = {}
    for name in ("ddp_no_sync", "ddp_no_sync_twin", "ddp_every_micro", "distaccum", "distaccum_no_checks"):
        variant = build_variant(name, spec, data, 0, torch.device("cpu"), HostClock(), tmp_path)
        assert len(variant.run(3)) == 4  # a stamp before the first step and after each
        trained[name] = torch.cat([p.detach().reshape(-1).clone() for p in variant.parameters()])
        variant.close()
    expert = trained.pop("ddp_no_sync")
    assert torch.equal(trained.pop("ddp_no_sync_twin"), expert)
    for name, params in trained.items():
        assert float((params - expert).abs().max() / expert.abs().max()) < 1e-6, name


def test_bf16_reaches_every_variant(tmp_path: Path) -> None:
    spec = launch_spec(SMOKE_CASES[0], 2, steps=1, precision="bf16")
    assert Spec.from_json(spec.to_json()).precision == "bf16"
    assert distaccum_config(spec, tmp_path)["precision"] == "bf16"
    loop = HAND_WRITTEN["compute_floor"](
        "compute_floor", spec, BenchData(spec, world_size=1), 0, torch.device("cpu"), HostClock()
    )
    seen: list[torch.dtype] = []
    loop.model.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    assert loop.loss(loop.model, loop.windows[0][0], 2).dtype == torch.float32 and seen == [torch.bfloat16]


def test_the_gpu_check_script_names_what_exists() -> None:
    """benchmarks/gpu_check.sh names real cases, variants and test files, and stays one shell script."""
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    assert all((ROOT / path).is_file() for path in re.findall(r"tests/\S+\.py", text))
    cases = re.search(r"cases=\$\{2:-([^}]+)\}", text).group(1).split(",")
    assert set(cases) == {c.name for c in (*FULL_CASES, *GPU_CASES)}
    variants = re.search(r"variants=\$\{VARIANTS:-([\w,]+)\}", text).group(1).split(",")
    assert tuple(variants) == TIMED
    (swept,) = [names for names in re.findall(r"--sweep ([\w,]+)", text) if names != "none"]
    check_variants(swept.split(","))
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")]).returncode == 0


def test_every_documented_benchmark_command_parses() -> None:
    """Each ``python -m benchmarks.run ...`` the docs show names options and variants the harness has."""
    import shlex

    from benchmarks.run import _options, parse_args

    pages = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
    commands = [
        " ".join(c.split())
        for page in pages
        for c in re.findall(r"`(python -m benchmarks\.run\b[^`]*)`", page.read_text(), re.S)
    ]
    commands += [
        " ".join(line.split("#")[0].split())
        for page in pages
        for block in re.findall(r"```(?:bash)?\n(.*?)```", page.read_text(), re.S)
        for line in block.splitlines()
        if line.strip().startswith("python -m benchmarks.run")
    ]
    checked = [c for c in commands if "..." not in c]
    assert len(checked) >= 4, commands
    for command in checked:
        _options(parse_args(shlex.split(command.replace("--device cuda", "--device cpu"))[3:]))
