"""The CI-sized benchmark: ``python -m benchmarks.run --smoke`` end to end on gloo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import ROOT, VARIANTS

pytestmark = pytest.mark.dist

ALL_RATIOS = ("d/b", "a/d", "d/e", "c/d", "d/d0", "a/b", "c/b", "b/e")


@pytest.mark.timeout(180)
def test_smoke_benchmark_measures_every_variant(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--rounds", "1", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert (tmp_path / "results.json").exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["cases"], "no case was measured"
    for case in results["cases"]:
        assert set(case["variants"]) == set(VARIANTS)
        for name, summary in case["variants"].items():
            assert summary["status"] == "ok", (case["case"], case["k"], name, summary["errors"])
            assert summary["step_s_median"] > 0
            assert all(t > 0 for t in summary["step_s_rounds"])
            assert summary["peak_rss_mb"] > 0
        assert set(case["ratios"]) == set(ALL_RATIOS)
        for label, ratio in case["ratios"].items():
            assert ratio is not None and ratio > 0, (label, ratio)
    assert results["memory"], "no peak-memory comparison"
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| case |" in (tmp_path / "results.md").read_text()
