"""``distaccum report`` on runs that logged the gradient noise scale: the markdown section (the figure's
panel is drawn in tests/test_gns.py, on a real run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distaccum.telemetry.markdown import render_markdown
from distaccum.telemetry.report import build_rows, discover

pytestmark = pytest.mark.unit


def write_run(path: Path, gns: bool) -> Path:
    path.mkdir(parents=True)
    records = []
    for i in range(1, 6):
        record = {
            "step": i,
            "loss": 2.0 / i,
            "samples": 16,
            "items": 64,
            "time_s": 0.1,
            "data_s": 0.01,
            "compute_s": 0.05,
            "comm_s": 0.02,
            "comm_exposed_s": 0.02,
            "optim_s": 0.02,
            "comm_bytes": 100,
            "comm_calls": 1,
            "peak_mem_bytes": 2**20,
        }
        if gns:
            record.update({"gns": 30.0 + 10 * (-1) ** i, "gns_smoothed": 30.0 + i})
        records.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "summary.json").write_text(
        json.dumps({"engine": "ddp", "micro_batch": 2, "accum_steps": 4, "world_size": 2, "global_batch": 16})
    )
    (path / "config.json").write_text(json.dumps({"log": {"warmup_steps": 1}}))
    return path


def test_report_shows_the_noise_scale_of_runs_that_measured_it(tmp_path: Path) -> None:
    runs = discover([write_run(tmp_path / "with", True), write_run(tmp_path / "without", False)])
    markdown = render_markdown(build_rows(runs, []), [], runs, 1e-4, 1e-6)
    section = markdown.split("## Gradient noise scale")[1]
    assert "| `with` | 64 | 35.0 | 0.55 |" in section and "`without`" not in section
    alone = discover([tmp_path / "without"])
    assert "Gradient noise scale" not in render_markdown(build_rows(alone, []), [], alone, 1e-4, 1e-6)
