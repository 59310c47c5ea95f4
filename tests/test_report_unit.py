"""The report's pure functions on hand-written run directories (the files a run writes)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import requires
from distaccum.telemetry.markdown import render_markdown
from distaccum.telemetry.report import (
    build_rows,
    check_agreement,
    compare_curves,
    discover,
    load_run,
    read_metrics,
    table_row,
)

pytestmark = pytest.mark.unit

CONFIG = {
    "model": {"_target_": "distaccum.models.TinyGPT", "width": 64},
    "data": {"dataset": {"_target_": "distaccum.datasets.CorpusSequences", "seed": 1}},
    "optim": {"lr": 0.003},
    "precision": "fp32",
    "trainer": {"seed": 0},
    "log": {"warmup_steps": 1},
    "accum": {"sync": "boundary", "loss_norm": "global_count"},
}


def step(n: int, loss: float, **extra: float) -> dict:
    base = {
        "step": n,
        "loss": loss,
        "samples": 16,
        "time_s": 0.5,
        "data_s": 0.05,
        "compute_s": 0.3,
        "comm_s": 0.2,
        "comm_exposed_s": 0.1,
        "optim_s": 0.05,
        "comm_bytes": 1000,
        "comm_calls": 2,
        "peak_mem_bytes": 2**20 * n,
    }
    return {**base, **extra}


def write_run(
    path: Path,
    losses: list[float] | None,
    *,
    status: dict | None = None,
    summary: bool = True,
    config: dict | None = None,
    overrides: list[str] | None = None,
) -> Path:
    path.mkdir(parents=True)
    if losses is not None:
        lines = [json.dumps(step(i + 1, loss)) for i, loss in enumerate(losses)]
        (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        (path / "summary.json").write_text(
            json.dumps(
                {
                    "engine": "ddp",
                    "sync": "boundary",
                    "loss_norm": "global_count",
                    "micro_batch": 2,
                    "accum_steps": 4,
                    "world_size": 2,
                    "global_batch": 16,
                }
            )
        )
    if status is not None:
        (path / "status.json").write_text(json.dumps(status))
    (path / "config.json").write_text(json.dumps(config or CONFIG))
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return path


def test_read_metrics_keeps_the_last_record_of_a_step_and_skips_a_torn_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        "\n".join(
            [json.dumps(step(1, 3.0)), json.dumps(step(2, 2.0)), json.dumps(step(2, 2.5)), '{"step": 3, "lo']
        )
        + "\n"
    )
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path)] == [(1, 3.0), (2, 2.5)]


@pytest.mark.parametrize(
    "status, summary, losses, expected",
    [
        (None, True, [1.0], "ok"),
        ({"status": "ok", "exit_code": 0}, False, [1.0], "incomplete"),
        (None, False, [1.0], "incomplete"),
        ({"status": "failed", "exit_code": 1}, False, [1.0], "failed"),
        ({"status": "invalid_config", "error": "bad split"}, False, None, "invalid_config"),
    ],
)
def test_run_status(
    tmp_path: Path, status: dict | None, summary: bool, losses: list[float] | None, expected: str
) -> None:
    run = load_run(write_run(tmp_path / "r", losses, status=status, summary=summary))
    assert run.status == expected
    if expected == "failed":
        assert run.error == "exit code 1"


def test_sweep_expands_in_job_order_with_the_overrides_that_vary(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for job, micro in ((10, 8), (2, 4), (0, 1)):
        write_run(
            sweep / str(job), [2.0, 1.0], overrides=[f"accum.micro_batch={micro}", "accum.global_batch=16"]
        )
    write_run(
        sweep / "1",
        None,
        status={"status": "invalid_config", "error": "not divisible"},
        summary=False,
        overrides=["accum.micro_batch=3", "accum.global_batch=16"],
    )
    (sweep / ".hydra").mkdir()
    runs = discover([sweep])
    assert [r.label for r in runs] == ["0", "1", "2", "10"]
    assert [r.overrides for r in runs] == [
        ["accum.micro_batch=1"],
        ["accum.micro_batch=3"],
        ["accum.micro_batch=4"],
        ["accum.micro_batch=8"],
    ]
    both = discover([sweep, sweep / "2"])
    assert [r.label for r in both][:4] == ["sweep/0", "sweep/1", "sweep/2", "sweep/10"]
    assert both[4].label == "2"
    with pytest.raises(ValueError, match="not a run directory"):
        discover([tmp_path / "empty"])


def test_labels_stay_unique(tmp_path: Path) -> None:
    runs = discover([write_run(tmp_path / "a" / "run", [1.0]), write_run(tmp_path / "b" / "run", [1.0])])
    assert [r.label for r in runs] == ["run", "run#2"]


def test_compare_curves_tolerance_and_first_bad_step() -> None:
    ref = {1: 2.0, 2: 1.0, 3: 0.5}
    assert compare_curves({1: 2.0, 2: 1.0 + 1e-4, 3: 0.5}, ref, rtol=1e-4, atol=0.0)[1] is None
    worst, first_bad, steps = compare_curves({1: 2.0, 2: 1.1, 3: 0.6, 4: 9.0}, ref, rtol=1e-4, atol=0.0)
    assert (first_bad, steps) == (2, 3) and worst == pytest.approx(0.2)


def test_agreement_picks_the_medoid_and_flags_the_outlier(tmp_path: Path) -> None:
    base = [3.0, 2.0, 1.5, 1.2]
    paths = [
        write_run(tmp_path / "a", base),
        write_run(tmp_path / "b", [x * (1 + 1e-7) for x in base]),
        write_run(tmp_path / "c", [3.0, 2.1, 1.6, 1.3]),
        write_run(
            tmp_path / "other_model", [9.0, 8.0, 7.0, 6.0], config={**CONFIG, "model": {"name": "mlp"}}
        ),
    ]
    runs = discover(paths)
    agreements = check_agreement(runs, rtol=1e-4, atol=1e-6)
    by_label = {a.label: a for a in agreements}
    assert set(by_label) | {agreements[0].reference} == {"a", "b", "c"}  # other_model is alone
    assert by_label["c"].first_bad_step == 2 and not by_label["c"].ok
    assert by_label["c"].reference in ("a", "b")
    rows = {r.label: r for r in build_rows(runs, agreements)}
    assert rows["c"].agreement.startswith("DISAGREES at step 2")
    assert rows["other_model"].agreement == "-"
    markdown = render_markdown(list(rows.values()), agreements, runs, 1e-4, 1e-6)
    assert "**1 run(s) disagree with their reference:**" in markdown
    assert "- `c` vs `" in markdown


def test_table_row_uses_steady_state_medians(tmp_path: Path) -> None:
    path = write_run(tmp_path / "r", None)
    records = [
        step(1, 3.0, compute_s=9.0),
        step(2, 2.0, compute_s=0.3),
        step(3, 1.0, compute_s=0.5),
        step(4, 0.5, compute_s=0.4),
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    row = table_row(load_run(path))
    assert row.compute_s == pytest.approx(0.4)  # step 1 (warm-up) excluded
    assert row.comm_share == pytest.approx(0.1 / 0.5)
    assert row.samples_per_s == pytest.approx(64 / 2.0)
    assert row.peak_mem_bytes == 4 * 2**20 and row.final_loss == 0.5 and row.split == "2x4x2=16"


def test_markdown_reports_invalid_runs_and_no_comparison(tmp_path: Path) -> None:
    runs = discover(
        [
            write_run(tmp_path / "only", [2.0, 1.0]),
            write_run(
                tmp_path / "bad", None, status={"status": "invalid_config", "error": "oops"}, summary=False
            ),
        ]
    )
    rows = build_rows(runs, [])
    assert math.isnan(rows[1].samples_per_s) and rows[1].steps == 0
    markdown = render_markdown(rows, [], runs, 1e-4, 1e-6)
    assert "nothing to compare" in markdown
    assert "- `bad`: invalid_config: oops" in markdown
    assert "| `bad` | invalid_config |" in markdown


def test_eval_lines_become_a_column_and_crosses_on_the_loss_panel(tmp_path: Path) -> None:
    path = write_run(tmp_path / "r", [3.0, 2.0, 1.5, 1.0])
    with (path / "metrics.jsonl").open("a") as f:
        for s, loss in ((0, 3.5), (2, 2.1), (4, 1.2)):
            f.write(json.dumps({"step": s, "eval_loss": loss, "eval_ppl": math.exp(loss)}) + "\n")
    run = load_run(path)
    assert [r["step"] for r in run.records] == [1, 2, 3, 4]  # eval lines are not steps
    assert run.eval_losses == {0: 3.5, 2: 2.1, 4: 1.2}
    rows = build_rows([run], [])
    assert rows[0].eval_loss == 1.2 and rows[0].final_loss == 1.0
    markdown = render_markdown(rows, [], [run], 1e-4, 1e-6)
    assert "| eval loss (ppl) |" in markdown and f"| 1.2000 ({math.exp(1.2):.2f}) |" in markdown
    requires("matplotlib")
    from distaccum.telemetry.figure import plot_report

    plot_report(rows, {"r": run.losses}, [], tmp_path / "report.png", 1e-4, {"r": run.eval_losses})
    assert (tmp_path / "report.png").stat().st_size > 10_000


def test_one_run_has_nothing_to_compare_and_no_agreement_panel(tmp_path: Path) -> None:
    runs = discover([write_run(tmp_path / "solo", [3.0, 2.0, 1.5])])
    agreements = check_agreement(runs, 1e-4, 1e-6)
    rows = build_rows(runs, agreements)
    markdown = render_markdown(rows, agreements, runs, 1e-4, 1e-6)
    assert "One run: nothing to compare" in markdown
    assert "1 run: " in markdown and "1 runs" not in markdown  # issue 56.10
    requires("matplotlib")
    import matplotlib.pyplot as plt

    from distaccum.telemetry.figure import report_figure

    fig = report_figure(rows, {r.label: r.losses for r in runs}, agreements, 1e-4)
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    assert len(titles) == 2 and not any("agreement" in t for t in titles), titles
    two = discover([write_run(tmp_path / "a", [3.0, 2.0]), write_run(tmp_path / "b", [3.0, 2.0])])
    agreements = check_agreement(two, 1e-4, 1e-6)
    rows = build_rows(two, agreements)
    assert "One run" not in render_markdown(rows, agreements, two, 1e-4, 1e-6)
    fig = report_figure(rows, {r.label: r.losses for r in two}, agreements, 1e-4)
    assert len(fig.axes) == 3 and fig.axes[2].get_title() == "loss agreement"
    plt.close(fig)


def test_runs_that_should_differ_are_not_compared_and_the_table_shows_outer_bytes_and_phases(
    tmp_path: Path,
) -> None:
    """Issue 56.2: a DiLoCo run against its synchronous baseline, and a ramp against an adaptive run, were compared
    and called disagreeing; the table showed neither the outer sync's bytes nor the batch's phases."""
    diloco = {**CONFIG, "outer": {"method": "diloco", "every": 2, "islands": 2}}
    ramp = {**CONFIG, "accum": {**CONFIG["accum"], "ramp": {"points": [[1, 8], [3, 16]]}}}
    adaptive = {**CONFIG, "accum": {**CONFIG["accum"], "adaptive": {"enabled": True, "every": 4}}}
    paths = [
        write_run(tmp_path / "sync", [3.0, 2.0, 1.5, 1.2]),
        write_run(tmp_path / "diloco", [3.0, 2.5, 1.9, 1.6], config=diloco),
        write_run(tmp_path / "ramp", [3.0, 2.0, 1.7, 1.4], config=ramp),
        write_run(tmp_path / "adaptive", [3.0, 2.2, 1.8, 1.5], config=adaptive),
    ]
    synced = [step(i + 1, 1.0, comm_bytes_outer=4096 if i % 2 else 0, outer_synced=i % 2) for i in range(4)]
    (paths[1] / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in synced) + "\n")
    ramp_summary = json.loads((paths[2] / "summary.json").read_text())
    ramp_summary["batch_phases"] = [[1, 8], [3, 16]]
    (paths[2] / "summary.json").write_text(json.dumps(ramp_summary))
    runs = discover(paths)
    assert check_agreement(runs, rtol=1e-4, atol=1e-6) == []  # each run alone in its group: nothing disagrees
    rows = {r.label: r for r in build_rows(runs, [])}
    markdown = render_markdown(list(rows.values()), [], runs, 1e-4, 1e-6)
    assert "2.0KiB outer (2 syncs)" in markdown  # 2 x 4 KiB over 4 steps
    assert "2x4x2=16 (8 -> 16)" in markdown
    requires("matplotlib")
    from distaccum.telemetry.figure import report_figure

    figure = report_figure(list(rows.values()), {r.label: r.losses for r in runs}, [], 1e-4)
    texts = [t.get_text() for t in figure.axes[0].texts]
    ticks = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert any("2.0KiB/step across islands" in t for t in texts) and "ramp 2x4x2=16 (8 -> 16)" in ticks
    # the same outer-synced config twice is comparable again
    twin = write_run(tmp_path / "diloco2", [3.0, 2.5, 1.9, 1.6 * (1 + 1e-9)], config=diloco)
    assert [a.label for a in check_agreement(discover([paths[1], twin]), 1e-4, 1e-6)] in (
        ["diloco"],
        ["diloco2"],
    )
