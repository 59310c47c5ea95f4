"""The tokens/s benchmark of hf_causal_lm (distaccum vs hand-written HF + DDP no_sync) runs at smoke size.

The figures themselves are measured by hand on a quiet machine (``python -m benchmarks.hf_tokens``);
here both variants must run in the same two ranks, alternate, and train the same trajectory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import ROOT
from conftest import requires
from hf_corpus import OFFLINE

pytestmark = pytest.mark.dist
requires("transformers")


@pytest.mark.timeout(240)
def test_smoke_benchmark_runs_both_variants_on_the_same_trajectory(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.hf_tokens", "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    spec = result["spec"]
    for name in ("distaccum", "hf_ddp"):
        variant = result["variants"][name]
        assert len(variant["tokens_per_s_rounds"]) == spec["rounds"]
        assert 0 < variant["tokens_per_s_min"] <= variant["tokens_per_s_median"] <= variant["tokens_per_s_max"]
        assert len(result["losses"][name]) == spec["warmup"] + spec["rounds"] * spec["steps"]
    # Same model, data and optimizer: the two loops follow the same loss curve (fp32 rounding apart).
    assert result["max_loss_rel_diff"] < 1e-5
    assert result["ratio_distaccum_over_hf_ddp"] > 0
    assert "| HF + DDP no_sync tokens/s |" in (tmp_path / "results.md").read_text()
