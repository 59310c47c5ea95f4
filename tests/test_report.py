"""``distaccum report`` on a real split sweep (with one invalid split) and a run that must disagree.

The sweep fixes the effective batch (16 samples per step, 2 ranks) and varies the micro-batch:
2 -> 2x4x2, 3 -> invalid (16 is not divisible by 3x2), 8 -> 8x1x2. A separate run with the classic
per-micro-batch mean (``accum.loss_norm=mean_per_micro``) on tiny_gpt's variable-length sequences
computes a different objective, so the report must flag it and exit 1.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, distaccum_cli, train
from distaccum.cli.report import report_main

pytestmark = pytest.mark.dist

COMMON = ("trainer.max_steps=4", "accum.global_batch=16", "trainer.nproc=2")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hydra multirun over micro-batch sizes (one of them invalid)."""
    run_dir = tmp_path_factory.mktemp("report") / "sweep"
    multirun = ["train", "--multirun", "accum.micro_batch=2,3,8", *COMMON]
    proc = distaccum_cli(
        [*multirun, "log.console=quiet", f"run_dir={run_dir}"], cwd=run_dir.parent, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return run_dir


@pytest.fixture(scope="module")
def wrong_norm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("report") / "mean_per_micro"
    train(run_dir, *COMMON, "accum.micro_batch=2", "accum.loss_norm=mean_per_micro")
    return run_dir


def table(markdown: str) -> dict[str, list[str]]:
    """Table rows of report.md by run label (first cell, without backticks)."""
    rows = [line.strip("|").split("|") for line in markdown.splitlines() if line.startswith("| `")]
    return {cells[0].strip().strip("`"): [c.strip() for c in cells] for cells in rows}


def check_png(path: Path) -> None:
    import matplotlib.image

    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width >= 800 and height >= 300
    rgb = (image[..., :3] * 255).round().astype(int)
    ink = (rgb < 250).any(axis=-1).mean()
    assert ink > 0.02, f"only {ink:.1%} of the figure is not white"
    colors = {tuple(c) for c in rgb.reshape(-1, 3)}
    assert len(colors) > 50
    for name, color in (("compute bars", (31, 119, 180)), ("exposed-comm bars", (214, 39, 40))):
        assert (np.abs(rgb - color).sum(axis=-1) < 6).sum() > 100, f"no {name} in the figure"


def test_sweep_report_lists_every_split_and_agrees(sweep: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(sweep)]) == 0
    markdown = (sweep / "report.md").read_text()
    assert capsys.readouterr().out.startswith(markdown)
    rows = table(markdown)
    assert set(rows) == {"0", "1", "2"}
    columns = [c.strip() for c in markdown.splitlines()[4].strip("|").split("|")]
    col = {name: i for i, name in enumerate(columns)}
    assert rows["0"][col["split (mb x K x W = G)"]] == "2x4x2=16"
    assert rows["2"][col["split (mb x K x W = G)"]] == "8x1x2=16"
    assert rows["1"][col["status"]] == "invalid_config"
    assert rows["1"][col["overrides"]] == "`accum.micro_batch=3`"
    for label in ("0", "2"):
        assert rows[label][col["status"]] == "ok" and rows[label][col["steps"]] == "4"
        assert float(rows[label][col["samples/s"]]) > 0
        assert rows[label][col["comm share"]].endswith("%")
        assert rows[label][col["peak mem"]].endswith("MiB")
        assert float(rows[label][col["final loss"]]) > 0
    assert {rows["0"][col["loss curve"]].split()[0], rows["2"][col["loss curve"]].split()[0]} == {
        "reference",
        "ok",
    }
    assert "All 2 comparable runs agree" in markdown
    assert "`1`: invalid_config: accum.global_batch=16 is not divisible" in markdown
    check_png(sweep / "report.png")


def test_report_flags_the_run_that_computes_another_objective(
    sweep: Path, wrong_norm: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert report_main([str(sweep), str(wrong_norm), "--out", str(out)]) == 1
    markdown = (out / "report.md").read_text()
    rows = table(markdown)
    assert set(rows) == {"sweep/0", "sweep/1", "sweep/2", "mean_per_micro"}
    assert "DISAGREES at step" in rows["mean_per_micro"][-1]
    assert "**1 run(s) disagree with their reference:**" in markdown
    check_png(out / "report.png")


def test_report_exit_codes(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_main([str(tmp_path / "nothing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    # the console script, end to end: runs given one by one, output elsewhere
    report = [sys.executable, "-m", "distaccum", "report"]
    ok = subprocess.run(
        [*report, str(sweep / "0"), str(sweep / "2"), "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert "| `0` | ok |" in ok.stdout
    assert (tmp_path / "report.png").is_file() and (tmp_path / "report.md").is_file()
