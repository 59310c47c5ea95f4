"""The benchmark harness's arithmetic and bookkeeping, in-process (no launches, no timings)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks import rerender
from benchmarks.cases import (
    FULL_CASES,
    GPU_CASES,
    LIMIT_CASES,
    SMOKE_CASES,
    BenchData,
    Spec,
    launch_spec,
    loss_sum,
)
from benchmarks.device import HostClock, mfu, model_flops_per_step, peak_tflops
from benchmarks.interleave import reference_of, round_order
from benchmarks.report import agreement_lines, render
from benchmarks.run import main as run_main
from benchmarks.run import memory_growth
from benchmarks.stats import (
    across_launches,
    interval_rank,
    launch_effect,
    median_interval,
    per_round_ratios,
    spread,
    summarize_launch,
    target,
    verdict,
)
from benchmarks.update_docs import markers, problems, replace_section, section_of
from benchmarks.variants import DEFAULT_VARIANTS, HAND_WRITTEN, check_variants, distaccum_config
from distaccum.config import RunConfig, from_mapping, to_mapping
from distaccum.data.pipeline import PlanSampler

pytestmark = pytest.mark.unit


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
    assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1  # every variant after every other alike


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
    """The same scatter of single rounds (a fixed pattern around 1.00, +-6 %) repeated: the IQR stays as wide, the
    median's interval closes in on it."""
    pattern = [0.94, 0.97, 0.99, 1.00, 1.01, 1.03, 1.06, 1.00]
    few, many = spread(pattern), spread(pattern * 10)
    assert (few.q1, few.q3) == pytest.approx((many.q1, many.q3), abs=0.011)
    assert few.ci_high - few.ci_low > 0.1 and many.ci_high - many.ci_low <= 0.02


def test_verdict_reads_the_median_s_interval() -> None:
    assert verdict(spread([1.00, 1.01, 1.01, 1.015]), 1.02) == "met"
    assert verdict(spread([1.00, 1.01, 1.03, 1.04]), 1.02) == "within the spread"
    assert verdict(spread([1.021, 1.05, 1.06, 1.07]), 1.02) == "missed"
    assert verdict(spread([1.5]), None) == ""
    scatter = [0.96, 0.98, 1.00, 1.00, 1.01, 1.02, 1.04, 1.06]  # the upper quartile beyond 1.02
    assert verdict(spread(scatter), 1.02) == "within the spread"
    assert verdict(spread(scatter * 8), 1.02) == "met"  # 64 rounds: x_(24)..x_(41) = 1.00..1.02
    assert verdict(spread([x + 0.025 for x in scatter] * 8), 1.02) == "missed"
    assert verdict(spread([x + 0.015 for x in scatter] * 8), 1.02) == "within the spread"
    assert target("distaccum / no_sync", "0.9M_micro256", 4) == 1.02
    assert target("distaccum / floor", "27.3M_micro4", 16) == 1.08
    assert target("distaccum / floor", "27.3M_micro4", 4) is None
    assert target("compiled: distaccum / hand-written", "27.3M_micro4", 1) == 1.02  # eager and compiled alike
    assert target("A/A compiled: twin / hand-written", "27.3M_micro4", 1) is None


def _timing_record(case: str = "smoke", k: int = 2, rounds: int = 6) -> dict[str, Any]:
    names = list(DEFAULT_VARIANTS)
    base = {"ddp_no_sync": 1.0, "distaccum": 1.01, "accelerate": 1.02, "compute_floor": 0.9, "ddp_every_micro": 1.5}
    spec = dataclasses.replace(launch_spec(SMOKE_CASES[0], k, rounds=rounds, variants=tuple(names)), case=case)
    return {"spec": json.loads(spec.to_json()), "orders": [round_order(names, r) for r in range(rounds)],
            "step_s": {n: [[base[n] * (1 + 0.1 * r)] * spec.steps for r in range(rounds)] for n in names},
            "param_rel_diff": {n: 0.0 for n in names} | {"compute_floor": 3e-3},
            "distaccum_ledger": {"distaccum": {"time_s": 1.0, "comm_rounds": 1.0, "comm_calls": 2.0}}, "busbw": None}


def test_summarize_launch_takes_ratios_round_by_round() -> None:
    row = summarize_launch(_timing_record())
    assert set(row["ratios"]) == {"distaccum / no_sync", "Accelerate / no_sync", "distaccum / floor",
                                  "no_sync / floor", "every_micro / no_sync"}  # no ledger-off variant ran
    ratio = row["ratios"]["distaccum / no_sync"]
    assert ratio["median"] == pytest.approx(1.01) and ratio["rounds"] == 6 and len(ratio["per_round"]) == 6
    assert ratio["target"] == 1.02 and ratio["verdict"] == "met"
    assert row["variants"]["distaccum"]["step_s"]["max"] == pytest.approx(1.01 * 1.5)


def _results(**settings: Any) -> dict[str, Any]:
    row = summarize_launch(_timing_record())
    row.update({"status": "ok", "launch": {"ok": True, "wall_s": 9.0, "load_1m": [1.5, 2.1], "error": ""}})
    sweep = [{"case": "smoke", "k": k, "variant": "distaccum_fsdp", "sync": "boundary", "status": "ok",
              "step_s": spread([0.01, 0.012]).as_dict(), "step_peak_mb": peak, "process_peak_mb": peak + 10,
              "setup_peak_mb": 300.0, "records": {"comm_rounds": 1.0, "comm_calls": 3.0, "comm_bytes": 7e3,
                                                   "gather_calls": 6.0 * k, "gather_bytes": 1.4e4 * k}}
             for k, peak in ((1, 300.0), (2, 320.0))]
    machine = {"cpu": "cpu", "logical_cpus": 2, "memory_gib": 1.0, "platform": "linux", "python": "3",
               "torch": "2", "accelerate": "1", "deepspeed": "0"}
    return {"date": "2026-11-23", "machine": machine, "wall_s": 10.0, "gpu": None, "timing": [row], "sweep": sweep,
            "memory": memory_growth(sweep),
            "cases": {"smoke": {"params": 1732, "micro_batch": 2}},
            "settings": {"command": "python -m benchmarks.run", "smoke": False, "rounds": 6, "device": "cpu",
                         "world_size": 2, "backend": "gloo", "threads": "1 thread", **settings}}


def test_memory_growth_flags_more_than_three_percent() -> None:
    (row,) = _results()["memory"]
    assert (row["k_low"], row["k_high"], row["flat"]) == (1, 2, False)
    assert row["step_growth"] == pytest.approx(320 / 300)


def test_report_holds_the_issue_table_and_every_section() -> None:
    text = render(_results())
    assert "| case | K | distaccum / no_sync | Accelerate / no_sync | distaccum / floor | no_sync / floor |" in text
    assert "1.010 (1.010-1.010)" in text  # median (IQR) of a ratio that never moved
    for fragment in ("Time per optimizer step", "distaccum's own ledger", "Same work", "Memory flat in K",
                     "12 (27.3 KiB)", "**no**", "GPU: not measured"):
        assert fragment in text, fragment


def test_rerender_adds_a_ratio_defined_after_the_run_from_its_rounds(tmp_path: Path) -> None:
    results = _results()
    row = results["timing"][0]
    row["variants"]["ddp_python_hook_after"] = {"round_s": [1.03 * t for t in row["variants"]["ddp_no_sync"]["round_s"]]}
    row["variants"]["ddp_python_hook"] = {"round_s": list(row["variants"]["ddp_no_sync"]["round_s"])}
    stale = dict(row["ratios"])  # what the run wrote: no ratio between the hook variants
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert rerender.main([str(path), "--out", str(tmp_path / "results.md")]) == 0
    text = (tmp_path / "results.md").read_text()
    line = next(x for x in text.splitlines() if "| Python hook: divided after / before (hand-written) |" in x)
    assert "| 1.030 |" in line  # every round 3 % slower: the median of the rounds' ratios
    assert "| distaccum / Python hook, divided after | 0.981 |" in text  # 1.01 / 1.03
    again = rerender.recomputed(results)["timing"][0]["ratios"]
    assert {k: v["median"] for k, v in again.items() if k in stale} == {k: v["median"] for k, v in stale.items()}
    assert rerender.main([str(tmp_path / "missing.json")]) == 2


def test_update_docs_replaces_only_its_section(tmp_path: Path) -> None:
    begin, end = markers("cpu")
    doc = f"# B\n\nprose above\n\n{begin}\n\nold figures\n\n{end}\n\nprose below\n"
    new = replace_section(doc, "cpu", "new figures")
    assert new == f"# B\n\nprose above\n\n{begin}\n\nnew figures\n\n{end}\n\nprose below\n"
    with pytest.raises(ValueError, match="bench:gpu"):
        replace_section(doc, "gpu", "x")


def test_update_docs_refuses_noise() -> None:
    assert any("partial" in p for p in problems(_results()))  # one smoke-sized launch, not every case and K
    assert problems(_results(), allow_partial=True) == []
    assert any("smoke" in p for p in problems(_results(smoke=True)))
    assert any("rounds" in p for p in problems(_results(rounds=3)))
    loaded = _results()
    loaded["timing"][0]["launch"]["load_1m"] = [6.0, 7.5]
    assert any("shared" in p for p in problems(loaded, allow_partial=True))
    assert problems(loaded, allow_loaded=True, allow_partial=True) == []
    failed = _results()
    failed["sweep"][0]["status"] = "failed"
    assert any("failed" in p for p in problems(failed))
    complete = _results()
    complete["timing"] = [{**complete["timing"][0], "case": c.name, "k": k} for c in FULL_CASES for k in c.ks]
    assert problems(complete) == []
    timing = {**complete, "sweep": []}  # python -m benchmarks.run --sweep none
    assert any("no engine sweep" in p for p in problems(timing))
    assert problems(timing, timing_only=True) == [] and section_of(timing, timing_only=True) == "cpu-timing"
    assert any("--timing-only with an engine sweep" in p for p in problems(complete, timing_only=True))
    stopped = {**timing, "finished": False}  # results.json as written after each launch of a run stopped part-way
    assert any("stopped part-way" in p for p in problems(stopped, timing_only=True))
    assert problems(stopped, timing_only=True, allow_partial=True) == []


def test_cases_have_the_issue_sizes() -> None:
    params = {c.name: c.shape.num_params() for c in FULL_CASES}
    assert round(params["27.3M_micro4"] / 1e6, 1) == 27.3 and round(params["0.9M_micro256"] / 1e6, 1) == 0.9
    for case in (*FULL_CASES, *SMOKE_CASES):
        with torch.device("meta"):
            model = case.shape.build()
        assert sum(p.numel() for p in model.parameters()) == case.shape.num_params()
    assert {c.micro_batch for c in FULL_CASES} == {4, 256} and all(c.ks == (1, 4, 16) for c in FULL_CASES)


def test_the_gpu_case_is_named_not_run_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    (case,) = GPU_CASES
    assert round(case.shape.num_params() / 1e6) == 210 and case.micro_batch == 1024 and case.ks == (1, 4, 16)
    assert run_main(["--cases", "27.3M_micro4,nope", "--device", "cpu"]) == 2  # refused before any launch
    err = capsys.readouterr().err
    assert "no case nope" in err and "210M_micro1024" in err


@pytest.fixture
def launched_specs(monkeypatch: pytest.MonkeyPatch) -> list[Spec]:
    """The spec of every launch ``benchmarks.run`` makes, in order; each launch fails at once (nothing runs)."""
    import benchmarks.run as bench_run
    from benchmarks.launch import Launch

    specs: list[Spec] = []

    def failing_launch(module: str, args: list[str], world: int, log: Path, timeout_s: float,
                       env: dict[str, str] | None = None) -> Launch:
        specs.append(Spec.from_json(args[0]))
        return Launch(False, [1] * world, 0.1, 1.0, (0.0, 0.0), "failed on purpose")

    monkeypatch.setattr(bench_run, "launch", failing_launch)
    return specs


def test_the_limit_cases_lie_between_the_standard_gradients_and_price_the_k1_choice(
        tmp_path: Path, launched_specs: list[Spec]) -> None:
    """``LIMIT_CASES``: gradients strictly between the two standard cases' (where ``engine.normalize_in_loss_mb``
    sits, 25 MiB, among them), each named by its size and reachable with ``--cases``; a launch of the two K = 1
    diagnostics yields their ratio."""
    mib = {c.name: c.shape.num_params() * 4 / 2**20 for c in FULL_CASES + LIMIT_CASES}
    limits = [mib[c.name] for c in LIMIT_CASES]
    assert mib["0.9M_micro256"] < min(limits) and max(limits) < mib["27.3M_micro4"]
    assert min(limits) < 25 < max(limits)
    assert all(c.name.startswith(f"{round(mib[c.name])}MiB") and c.ks == (1,) for c in LIMIT_CASES)
    names = ",".join(c.name for c in LIMIT_CASES)
    assert run_main(["--cases", names, "--sweep", "none", "--device", "cpu", "--out", str(tmp_path),
                     "--variants", "ddp_no_sync,distaccum_in_loss,distaccum_folded_k1"]) == 1
    assert [(s.case, s.accum_steps) for s in launched_specs] == [(c.name, 1) for c in LIMIT_CASES]
    names = ["distaccum_in_loss", "distaccum_folded_k1"]
    record = {**_timing_record(), "orders": [round_order(names, r) for r in range(4)],
              "step_s": {"distaccum_in_loss": [[1.1]] * 4, "distaccum_folded_k1": [[1.0]] * 4}}
    assert summarize_launch(record)["ratios"]["K = 1: 1/N in the loss / folded"]["median"] == pytest.approx(1.1)


def test_a_run_keeps_each_launch_on_disk_as_it_finishes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run stopped part-way (a lease that ends, a timeout) keeps the launches it finished: results.json is
    rewritten after each one, ``finished`` false until the end. The launcher is replaced by one that fails at
    once, recording what was on disk when each launch started."""
    import benchmarks.run as bench_run
    from benchmarks.launch import Launch

    on_disk: list[Any] = []
    precisions: list[str] = []

    def failing_launch(module: str, args: list[str], world: int, log: Path, timeout_s: float,
                       env: dict[str, str] | None = None) -> Launch:
        path = tmp_path / "results.json"
        on_disk.append(json.loads(path.read_text()) if path.exists() else None)
        precisions.append(Spec.from_json(args[0]).precision)
        return Launch(False, [1] * world, 0.1, 1.0, (0.0, 0.0), "failed on purpose")

    monkeypatch.setattr(bench_run, "launch", failing_launch)
    assert run_main(["--smoke", "--sweep", "none", "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert on_disk[0] is None and on_disk[1]["finished"] is False
    assert [(r["case"], r["k"], r["status"]) for r in on_disk[1]["timing"]] == [("smoke", 1, "failed")]
    final = json.loads((tmp_path / "results.json").read_text())
    assert final["finished"] is True and len(final["timing"]) == 2
    on_disk.clear()  # the engine sweep alike (fresh processes per case, K and variant)
    (tmp_path / "results.json").unlink()
    assert run_main(["--smoke", "--no-timing", "--sweep", "ddp_no_sync,distaccum", "--precision", "bf16",
                     "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert on_disk[0] is None and [len(d["sweep"]) for d in on_disk[1:]] == [1, 2, 3]
    assert all(d["finished"] is False and d["settings"]["precision"] == "bf16" for d in on_disk[1:])
    assert precisions == ["fp32"] * 2 + ["bf16"] * 4  # the sweep's launches compute in what the run says


def test_repeat_launches_every_split_again_after_the_others(tmp_path: Path, launched_specs: list[Spec],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """``--repeat N``: every case and K once, then again (a split's launches spread over the run), each row
    numbered; 0 is refused."""
    assert run_main(["--cases", "0.9M_micro256", "--ks", "1,4", "--repeat", "3", "--sweep", "none",
                     "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert [s.accum_steps for s in launched_specs] == [1, 4] * 3
    rows = json.loads((tmp_path / "results.json").read_text())["timing"]
    assert [(r["k"], r["repeat"], r["repeats"]) for r in rows] == [(1, 0, 3), (4, 0, 3), (1, 1, 3), (4, 1, 3),
                                                                   (1, 2, 3), (4, 2, 3)]
    assert run_main(["--repeat", "0", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "--repeat must be >= 1" in capsys.readouterr().err


def _launch_rows(ratios: list[float], label: str = "distaccum / no_sync") -> list[dict[str, Any]]:
    rows = []
    for i, ratio in enumerate(ratios):
        row = summarize_launch(_timing_record(case="0.9M_micro256", k=1))
        row["ratios"][label] = {**spread([ratio] * 6).as_dict(), "per_round": [ratio] * 6, "target": 1.02,
                                "verdict": ""}
        row.update({"status": "ok", "repeat": i, "repeats": len(ratios),
                    "launch": {"ok": True, "wall_s": 9.0, "load_1m": [1.5, 2.1], "error": ""}})
        rows.append(row)
    return rows


def test_the_verdict_across_launches_takes_each_launch_s_median_as_one_value() -> None:
    """Six launches that each look tight inside: met only when every launch's median is within the target, missed
    only when every one is beyond it; five launches give no verdict (their min-max holds the median with 94 %)."""
    def judged(ratios: list[float]) -> dict[str, Any]:
        (row,) = [r for r in across_launches(_launch_rows(ratios)) if r["ratio"] == "distaccum / no_sync"]
        return row
    met = judged([1.00, 1.01, 0.99, 1.015, 1.00, 1.02])
    assert (met["verdict"], met["median"], met["min"], met["max"]) == ("met", 1.005, 0.99, 1.02)
    assert judged([1.00, 1.01, 0.99, 1.015, 1.00, 1.03])["verdict"] == "within the spread"
    assert judged([1.03, 1.04, 1.021, 1.05, 1.06, 1.07])["verdict"] == "missed"
    assert judged([1.00, 1.01, 0.99, 1.015, 1.00])["verdict"] == "too few launches"
    assert across_launches(_launch_rows([1.0])) == []  # one launch: nothing across launches
    results = _results()
    results["timing"] = _launch_rows([1.00, 1.01, 0.99, 1.015, 1.00, 1.02])
    results["settings"]["repeats"] = 6
    text = render(results)
    assert "Across launches" in text and "| 1 #6 |" in text and "6 launches per case and K" in text
    assert "| 0.9M_micro256 | 1 | distaccum / no_sync | 1.005 | 0.990-1.020 | 1.000 1.010 0.990 1.015 1.000 1.020 " \
        "| <= 1.02 | met | 1.005 (1.000-1.015, 36 rounds) |" in text
    # pooled: 36 rounds, 6 per launch; the interval is x_(12)..x_(25) of 0.99 x6, 1.00 x12, 1.01 x6, 1.015 x6, 1.02 x6
    brief = render(results, across_only=True)  # what update_docs writes for a --repeat run
    assert "Across launches" in brief and "Median of the per-round ratios" not in brief and "Same work" in brief
    assert section_of(results, timing_only=True) == "cpu-launches"
    assert any("--timing-only" in p for p in problems(results))


def test_block_sets_the_timed_steps_per_round(tmp_path: Path, launched_specs: list[Spec],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``--block N``: each variant's block is ceil(N / K) optimizer steps, never under the case's minimum (the
    launcher is replaced by one that records each launch's spec and fails at once)."""
    specs = launched_specs
    assert run_main(["--cases", "0.9M_micro256", "--ks", "1,4,16,64", "--block", "64", "--sweep", "none",
                     "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert [(s.accum_steps, s.steps) for s in specs] == [(1, 64), (4, 16), (16, 4), (64, 3)]
    specs.clear()
    assert run_main(["--cases", "0.9M_micro256", "--ks", "1,4", "--sweep", "none", "--device", "cpu",
                     "--out", str(tmp_path)]) == 1
    assert [s.steps for s in specs] == [16, 4]  # the case's own block
    assert run_main(["--block", "0", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "--block must be >= 1" in capsys.readouterr().err


def test_block_steps_sets_the_same_optimizer_steps_per_block_at_every_k(
        tmp_path: Path, launched_specs: list[Spec], capsys: pytest.CaptureFixture[str]) -> None:
    """``--block-steps N``: every block is N optimizer steps whatever K (1: the variants alternate step by step), and
    the time budget reaches every launch; ``--block`` with it, 0 steps and a budget that is not positive are
    refused."""
    assert run_main(["--cases", "0.9M_micro256", "--ks", "1,4,16", "--block-steps", "1", "--budget-s", "90",
                     "--sweep", "none", "--device", "cpu", "--out", str(tmp_path)]) == 1
    assert [(s.accum_steps, s.steps, s.budget_s, s.rounds) for s in launched_specs] == [
        (1, 1, 90.0, 100_000), (4, 1, 90.0, 100_000), (16, 1, 90.0, 100_000)]  # the budget decides, the cap is far
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["settings"]["block_steps"], results["settings"]["budget_s"]) == (1, 90.0)
    assert section_of(results, timing_only=True) == "cpu-budget"  # its own section of BENCHMARKS.md
    for bad, said in ((["--block", "16", "--block-steps", "1"], "give one"), (["--block-steps", "0"], ">= 1"),
                      (["--budget-s", "0"], "must be positive")):
        assert run_main([*bad, "--device", "cpu", "--out", str(tmp_path)]) == 2
        assert said in capsys.readouterr().err


def test_the_launch_effect_tells_launches_that_move_a_ratio_from_ones_that_do_not() -> None:
    """:func:`launch_effect`: six launches whose rounds scatter alike give a launch spread near what their rounds'
    noise gives (ratio near 1); the same rounds with each launch shifted by its own factor give one far above it."""
    noise = [math.exp(0.1 * math.sin(1.7 * i * i + 0.3 * i)) for i in range(600)]  # fixed, roughly symmetric
    launches = [noise[j * 100:(j + 1) * 100] for j in range(6)]
    alike = launch_effect(launches)
    assert 0.3 < alike["launch_sd"] / alike["expected_sd"] < 2.0
    shifted = launch_effect([[x * f for x in rounds] for rounds, f in zip(launches, (0.94, 1.0, 1.06, 0.97, 1.03, 1.0),
                                                                        strict=True)])
    assert shifted["expected_sd"] == pytest.approx(alike["expected_sd"], rel=0.2)
    assert shifted["launch_sd"] / shifted["expected_sd"] > 3.0
    assert math.isnan(launch_effect([[1.0, 1.1]])["launch_sd"])  # one launch shows nothing
    rows = _launch_rows([1.00, 1.01, 0.99, 1.015, 1.00, 1.02])
    (row,) = [r for r in across_launches(rows) if r["ratio"] == "distaccum / no_sync"]
    assert row["expected_sd"] == 0.0 and row["launch_sd"] > 0  # rounds without noise: every spread is the launches'


def test_bf16_reaches_every_variant(tmp_path: Path) -> None:
    """``--precision bf16``: the hand-written loops' forward and loss run under bf16 autocast (loss in fp32,
    as autocast does), distaccum gets ``precision=bf16``; fp32 leaves both alone."""
    spec = launch_spec(SMOKE_CASES[0], 2, precision="bf16")
    assert Spec.from_json(spec.to_json()).precision == "bf16"
    assert distaccum_config(spec, tmp_path)["precision"] == "bf16"
    loop = HAND_WRITTEN["compute_floor"]("compute_floor", spec, BenchData(spec, world_size=1), 0,
                                         torch.device("cpu"), HostClock())
    seen: list[torch.dtype] = []
    loop.model.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    batch = loop.windows[0][0]
    assert loop.loss(loop.model, batch, 2).dtype == torch.float32 and seen == [torch.bfloat16]
    fp32 = launch_spec(SMOKE_CASES[0], 2)
    assert distaccum_config(fp32, tmp_path)["precision"] == "fp32"
    loop = HAND_WRITTEN["compute_floor"]("compute_floor", fp32, BenchData(fp32, world_size=1), 0,
                                         torch.device("cpu"), HostClock())
    loop.model.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    loop.loss(loop.model, batch, 2)
    assert seen[-1] == torch.float32


def test_spec_round_trips_through_json() -> None:
    spec = launch_spec(FULL_CASES[0], 16, rounds=8, variants=DEFAULT_VARIANTS)
    assert Spec.from_json(spec.to_json()) == spec
    assert (spec.steps, spec.warmup, spec.total_steps) == (3, 2, 2 + 8 * 3)


@pytest.mark.parametrize("rank", [0, 1])
def test_hand_written_loops_see_the_trainer_s_micro_batches_as_views(rank: int) -> None:
    spec = launch_spec(SMOKE_CASES[0], 2)
    data = BenchData(spec, world_size=2)
    windows = data.windows(rank)
    plan = data.plan()
    sampler = PlanSampler(plan, data.split, rank, 0, plan.windows_per_epoch)  # what the Trainer's DataLoader walks
    for (x, y), indices in zip((b for w in windows for b in w), sampler, strict=True):
        expect_x, expect_y = data.collate(indices)
        assert torch.equal(x, expect_x) and torch.equal(y, expect_y)
        assert x.untyped_storage().data_ptr() == data.x.untyped_storage().data_ptr()  # a view, no copy


def test_distaccum_loss_over_the_global_count_is_the_hand_written_mean() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 4)
    micro = [(torch.randn(5, 3), torch.randn(5, 4)) for _ in range(3)]  # K=3 on one rank
    with torch.no_grad():
        hand = sum(F.mse_loss(model(x), y) / len(micro) for x, y in micro)
        sums, counts = zip(*(loss_sum(model, b) for b in micro), strict=True)
    assert float(sum(sums) / sum(counts)) == pytest.approx(float(hand), rel=1e-6)


def test_distaccum_variant_changes_only_the_documented_settings(tmp_path: Path) -> None:
    spec = launch_spec(FULL_CASES[1], 4, rounds=8)
    cfg = to_mapping(from_mapping(distaccum_config(spec, tmp_path)))
    default = to_mapping(RunConfig())
    changed = {f"{section}.{key}" for section, values in cfg.items() if isinstance(values, dict)
               for key, value in values.items() if default[section][key] != value}
    assert changed == {"accum.micro_batch", "optim.schedule", "optim.warmup_steps", "optim.clip_norm",
                       "trainer.max_steps", "trainer.device", "trainer.check_every", "trainer.checkpoint_every",
                       "trainer.save_final", "data.shuffle", "log.console", "log.warmup_steps", "log.grad_norm"}
    assert cfg["log"]["ledger"] is True and cfg["accum"]["sync"] == "auto" and cfg["engine"]["name"] == "ddp"


def test_check_variants_refuses_unknown_names_and_two_accelerators() -> None:
    check_variants([*DEFAULT_VARIANTS, "distaccum_no_ledger", "distaccum_zero2"])
    with pytest.raises(ValueError, match="horovod"):
        check_variants(["horovod"])
    with pytest.raises(ValueError, match="singleton"):
        check_variants(["accelerate", "distaccum_accelerate"])


def test_mfu_is_model_flops_over_the_peak() -> None:
    assert model_flops_per_step(1000, 8) == 48_000
    assert mfu(10**9, 4, step_s=0.5, peak=48.0) == pytest.approx(6 * 4e9 / 0.5 / 48e12)
    assert mfu(10**9, 4, step_s=0.5, peak=None) is None
    assert peak_tflops("fp32", override=100.0) == (100.0, "--peak-tflops")


@pytest.mark.parametrize("name", ["ddp_no_sync", "ddp_every_micro"])
def test_the_hand_written_ddp_loops_use_an_experts_settings(cpu_group: None, name: str) -> None:
    """The baselines are the strongest reasonable loops: gradients as DDP bucket views, zeroed in place (so
    the same gradient storage serves every window), as distaccum's DDP engine does."""
    spec = launch_spec(SMOKE_CASES[0], 2)
    loop = HAND_WRITTEN[name](name, spec, BenchData(spec, world_size=1), 0, torch.device("cpu"), HostClock())
    assert loop.ddp.gradient_as_bucket_view is True
    loop.run(2)  # DDP rebuilds its buckets once, after the first iteration
    storages = [p.grad.untyped_storage().data_ptr() for p in loop.model.parameters()]
    assert all(p.grad is not None and not p.grad.any() for p in loop.model.parameters())  # zeroed, kept
    loop.run(2)
    assert [p.grad.untyped_storage().data_ptr() for p in loop.model.parameters()] == storages


@pytest.mark.parametrize(("name", "hook"), [("ddp_window_allreduce", "window_allreduce_hook"),
                                          ("ddp_window_allgather", "window_allreduce_hook"),
                                          ("ddp_python_hook_after", "python_allreduce_after_hook"),
                                          ("ddp_no_sync_twin", None)])
def test_the_hook_diagnostics_train_what_the_no_sync_loop_trains(cpu_group: None, name: str, hook: str) -> None:
    """``ddp_window_allgather`` and ``ddp_window_allreduce`` (what ``benchmarks.fixed_cost`` prices distaccum's window
    collective with, as it is and as it was) only add a collective, and ``ddp_python_hook_after`` only moves the division by the world size to after the
    all-reduce: the same parameters as ``ddp_no_sync``, bit for bit, through their own comm hook (and the window's
    collective was waited for). ``ddp_no_sync_twin``, the A/A control, is the same loop built again."""
    spec = launch_spec(SMOKE_CASES[0], 2)
    data = BenchData(spec, world_size=1)
    loops = {n: HAND_WRITTEN[n](n, spec, data, 0, torch.device("cpu"), HostClock()) for n in ("ddp_no_sync", name)}
    for loop in loops.values():
        loop.run(3)
    plain, diagnostic = ([p.detach() for p in loop.parameters()] for loop in loops.values())
    assert all(torch.equal(a, b) for a, b in zip(plain, diagnostic, strict=True))
    assert loops[name].ddp._get_ddp_logging_data().get("comm_hook") == hook
    if name.startswith("ddp_window_"):
        assert loops[name].pending["work"].is_completed()


def test_the_device_totals_diagnostic_trains_what_distaccum_trains_and_restores_the_loop(
        cpu_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``distaccum_device_totals`` (what ``benchmarks.fixed_cost`` prices the CPU's Python-float window totals with)
    and ``distaccum_host_allreduce`` (the all-gather against the all-reduce it replaced) run the loop with their
    kind only while they run, as does ``distaccum_gloo_window`` (the rows through gloo, not the run's sockets): the
    same parameters as ``distaccum`` bit for bit, the same totals from either collective, and the CPU gets
    :class:`HostTotals` over the run's sockets again afterwards."""
    from benchmarks.variants import HostTotalsAllreduce, HostTotalsGloo, build_variant
    from distaccum import window

    spec = launch_spec(SMOKE_CASES[0], 2)
    data = BenchData(spec, world_size=1)
    kinds: list[tuple[type, str | None]] = []
    real = window.WindowTotals.read

    def noting(self: window.WindowTotals) -> window.WindowResult:  # wraps the real read: records kind and transport
        exchange = getattr(self, "exchange", None)
        kinds.append((type(self), None if exchange is None else exchange.name))
        return real(self)

    monkeypatch.setattr(window.WindowTotals, "read", noting)
    trained = {}
    records = {}
    for name in ("distaccum", "distaccum_device_totals", "distaccum_host_allreduce", "distaccum_gloo_window"):
        variant = build_variant(name, spec, data, 0, torch.device("cpu"), HostClock(), tmp_path / name)
        records[name] = variant.run(3) and variant.trainer.state.records  # type: ignore[attr-defined]
        trained[name] = [p.clone() for p in variant.parameters()]
        variant.close()
    assert kinds == ([(window.HostTotals, "sockets")] * 3 + [(window.DeviceTotals, None)] * 3
                     + [(HostTotalsAllreduce, "sockets")] * 3 + [(HostTotalsGloo, "gloo")] * 3)
    for name in ("distaccum_device_totals", "distaccum_host_allreduce", "distaccum_gloo_window"):
        assert all(torch.equal(a, b) for a, b in zip(trained["distaccum"], trained[name], strict=True))
        assert [(r["loss"], r["items"]) for r in records[name]] == [(r["loss"], r["items"]) for r in records["distaccum"]]
    assert type(window.WindowTotals.for_device(spec.split(1), 0, torch.device("cpu"))) is window.HostTotals


def test_distaccum_gets_the_tensors_in_memory_and_the_loader_diagnostic_the_dataloader_same_training(
        cpu_group: None, tmp_path: Path) -> None:
    """``distaccum`` gets the benchmark's samples as a ``TensorDataset`` (cut in the process: ``TensorRows``),
    ``distaccum_loader`` the index dataset and slicing collate through a DataLoader, ``distaccum_copied_rows`` the
    same rows copied in its loss: the same parameters bit for bit, so each ratio prices the data path alone."""
    import inspect

    from benchmarks.variants import build_variant

    spec = launch_spec(SMOKE_CASES[0], 2)
    data = BenchData(spec, world_size=1)
    trained, generators = {}, {}
    for name in ("distaccum", "distaccum_loader", "distaccum_copied_rows"):
        variant = build_variant(name, spec, data, 0, torch.device("cpu"), HostClock(), tmp_path / name)
        variant.run(3)
        generators[name] = inspect.isgenerator(variant.trainer.state.source._batches)  # type: ignore[attr-defined]
        trained[name] = [p.clone() for p in variant.parameters()]
        variant.close()
    assert generators == {"distaccum": True, "distaccum_loader": False, "distaccum_copied_rows": True}
    for name in ("distaccum_loader", "distaccum_copied_rows"):
        assert all(torch.equal(a, b) for a, b in zip(trained["distaccum"], trained[name], strict=True)), name


def test_the_fixed_cost_groups_leave_out_nested_pieces_and_the_optimizer() -> None:
    """The group sums of ``fixed_cost --sections``: a piece timed inside another is counted once, and the engine step
    is distaccum's own work only without the optimizer's step and zero_grad inside it."""
    from benchmarks.fixed_cost import ENGINE, FINGERPRINT, WINDOW, own_groups

    pieces = {"ReplicatedEngine.step": [0.0, 300.0, 1.0], "SGD.step": [0.0, 100.0, 1.0],
              "Optimizer.zero_grad": [0.0, 80.0, 1.0], "replicated.normalize_": [0.0, 200.0, 1.0],
              "HostTotals.grad_scale": [0.0, 150.0, 2.0], "HostTotals.reduce": [0.0, 250.0, 1.0],
              "Fingerprint.before_reduce": [0.0, 30.0, 1.0], "WindowTotals.carry": [0.0, 25.0, 1.0]}
    assert own_groups(pieces) == {ENGINE: 120.0, WINDOW: 450.0, FINGERPRINT: 30.0}


def test_the_data_fetch_benchmark_runs_every_path(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.data_fetch import main

    main(["--samples", "64", "--features", "4", "--micro", "4", "--plan-samples", "1000", "--repeats", "1"])
    out = capsys.readouterr().out
    for line in ("DataLoader, sample by sample + default_collate", "DataLoader, TensorBatches",
                 "in the process, TensorRows (shuffled", "in the process, TensorRows (in order",
                 "order drawn anew (before)", "epoch order kept"):
        assert line in out


def test_the_folded_k1_diagnostic_turns_the_in_loss_normalization_off_only_while_it_runs(
        cpu_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``distaccum_folded_k1`` prices ``engine.normalize_in_loss_mb``: its engine declines the in-loss normalization
    while it runs (the reduction folds 1/N in), and offers it again afterwards; ``distaccum_in_loss`` takes it
    whatever the gradient's size. Both train what ``distaccum`` trains (N is a power of two here: bit for bit)."""
    from benchmarks.run import SWEEP_VARIANTS
    from benchmarks.variants import build_variant
    from distaccum.engines.replicated import ReplicatedEngine

    spec = launch_spec(SMOKE_CASES[0], 1)
    data = BenchData(spec, world_size=1)
    offers: list[tuple[str, bool]] = []
    real = ReplicatedEngine.normalize_loss

    def noting(self: ReplicatedEngine, scale: Any) -> Any:  # wraps the real method: records whether it took 1/N
        factor = real(self, scale)
        offers.append((self.spec.engine.normalize_in_loss_mb, factor is not None))
        return factor

    monkeypatch.setattr(ReplicatedEngine, "normalize_loss", noting)
    trained = {}
    for name in ("distaccum", "distaccum_in_loss", "distaccum_folded_k1"):
        variant = build_variant(name, spec, data, 0, torch.device("cpu"), HostClock(), tmp_path / name)
        variant.run(2)
        trained[name] = [p.clone() for p in variant.parameters()]
        engine = variant.trainer.state.engine  # type: ignore[attr-defined]
        assert "normalize_loss" not in vars(engine)  # the diagnostic's override is gone
        variant.close()
    assert offers == [(25.0, False)] * 2 + [(0, True)] * 2  # the diagnostic never reached the engine's method
    for name in ("distaccum_in_loss", "distaccum_folded_k1"):
        assert all(torch.equal(a, b) for a, b in zip(trained["distaccum"], trained[name], strict=True))
    assert not {"distaccum_folded_k1", "distaccum_in_loss", "distaccum_device_totals", "distaccum_loader",
                "distaccum_sync_records"} & set(SWEEP_VARIANTS)


def test_a_gpu_sweep_names_the_allocator_peak_and_lists_no_empty_mfu_table() -> None:
    # the engine sweep run on the lent H100 (BENCHMARKS.md's GPU figures): no timing, CUDA allocator peaks
    results = json.loads((Path(__file__).parents[1] / "docs/results/gpu-h100-bf16-sweep.json").read_text())
    text = render(results)
    assert "peak CUDA memory allocated" in text and "peak RSS" not in text
    assert "| case | K | variant | step ms | MFU |" not in text  # nothing timed, so no MFU rows
    cpu = json.loads(json.dumps(results))
    cpu["settings"]["device"], cpu["gpu"] = "cpu", None
    assert "peak RSS" in render(cpu) and "peak CUDA memory" not in render(cpu)


def test_a_gpu_timing_run_says_once_per_case_why_its_bus_bandwidth_was_not_measured() -> None:
    results = json.loads((Path(__file__).parents[1] / "docs/results/gpu-h100-bf16-timing.json").read_text())
    lines = [line for line in render(results).splitlines() if line.startswith("- NCCL all-reduce")]
    assert len(results["gpu"]["busbw"]) == 8  # one per (case, K) launch: three cases, 210M's K = 16 not reached
    assert [line.split(",")[1].split(":")[0].strip() for line in lines] == [
        "27.3M_micro4", "0.9M_micro256", "210M_micro1024"]


def test_the_cuda_step_profile_reports_kernel_time_and_what_the_gpu_waited() -> None:
    from benchmarks.step_profile import report

    record = {name: {"step_s": [0.010, 0.009, 0.011], "table": "", "python": "", "python_own": "",
                     "ops": {"aten::mm": (8, 1.0)}, "device_ms": device_ms} for name, device_ms in (("ddp_no_sync", 70.0), ("distaccum", 72.0))}
    text = report(record, steps=8)
    assert "kernels 8.750 ms/step of a 10.000 ms median step (the GPU waited 1.250 ms/step for the host)" in text
    assert "kernels 9.000 ms/step" in text
    record["distaccum"]["device_ms"] = record["ddp_no_sync"]["device_ms"] = None  # a CPU profile: no kernel line
    assert "kernels" not in report(record, steps=8)


def test_a_run_without_the_expert_loop_compares_parameters_with_its_first_hand_written_loop() -> None:
    assert reference_of(["distaccum", "ddp_no_sync_compiled", "ddp_no_sync"]) == "ddp_no_sync"
    compiled = ["ddp_no_sync_compiled", "distaccum_compiled", "ddp_no_sync_compiled_twin"]
    assert reference_of(compiled) == "ddp_no_sync_compiled"
    assert reference_of(["compute_floor", "distaccum"]) is None  # the floor must differ: never the reference
    row = {"param_rel_diff": {"ddp_no_sync_compiled": 0.0, "distaccum_compiled": 4e-8, "ddp_no_sync_compiled_twin": 0.0},
           "param_reference": "ddp_no_sync_compiled"}
    (line,) = agreement_lines({"timing": [row], "settings": {"world_size": 2}})
    assert "compared with ddp_no_sync_compiled's" in line and "distaccum_compiled 4.0e-08" in line
    assert "ddp_no_sync_compiled 0.0e+00" not in line
