"""The CI size of the benchmark, end to end on gloo: structure, counts and the render path, never timings."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from benchmarks import report
from benchmarks.launch import ROOT
from benchmarks.run import SMOKE_SWEEP, SMOKE_TIMED

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def smoke(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[dict[str, Any], Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("bench")
    # DeepSpeed compiles its CPU op on first use in a checkout (~40 s, once): hence the generous limit.
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert (out / "results.json").exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), out, proc


@pytest.mark.timeout(420)
def test_every_variant_is_timed_in_every_round_of_one_launch(smoke: tuple[dict[str, Any], Path, Any]) -> None:
    results, _, proc = smoke
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [(r["case"], r["k"]) for r in results["timing"]] == [("smoke", 1), ("smoke", 2)]
    assert results["finished"] is True
    for row in results["timing"]:
        assert row["status"] == "ok", row["launch"]["error"]
        assert set(row["variants"]) == set(SMOKE_TIMED)
        assert (
            len(row["orders"]) == row["rounds"] == 2 and row["orders"][0] != row["orders"][1]
        )  # balanced order
        for name, v in row["variants"].items():
            assert len(v["round_s"]) == 2 and all(t > 0 for t in v["round_s"]), name
        for label in (
            "distaccum / expert",
            "distaccum / floor",
            "expert / floor",
            "A/A: expert twin / expert",
        ):
            ratio = row["ratios"][label]
            assert all(math.isfinite(x) and x > 0 for x in ratio["per_round"]), label
            assert ratio["min"] <= ratio["ci_low"] <= ratio["median"] <= ratio["ci_high"] <= ratio["max"]


@pytest.mark.timeout(420)
def test_a_run_records_the_code_and_environment_it_measured(smoke: tuple[dict[str, Any], Path, Any]) -> None:
    meta = smoke[0]["meta"]
    assert len(meta["commit"]) == 12 or meta["commit"] == "unknown"
    assert len(meta["source_sha256"]) == 12 and meta["torch"] == torch.__version__
    assert (meta["device"], meta["backend"], meta["world_size"], meta["logical_cpus"]) == (
        "cpu",
        "gloo",
        2,
        os.cpu_count(),
    )
    assert (
        meta["threads"] == "1 intra-op thread per rank"
        and meta["cpu"]
        and meta["command"].startswith("python -m benchmarks.run --smoke")
    )


@pytest.mark.timeout(420)
def test_variants_train_the_same_model_on_the_same_data(smoke: tuple[dict[str, Any], Path, Any]) -> None:
    for row in smoke[0]["timing"]:
        diffs = row["param_rel_diff"]
        assert row["param_reference"] == "ddp_no_sync" and diffs["ddp_no_sync_twin"] == 0.0
        assert diffs["distaccum"] < 1e-5, (row["k"], diffs["distaccum"])
        # The floor averages nothing over ranks: it must train something else (a negative control).
        assert diffs["compute_floor"] > 1e-4


@pytest.mark.timeout(420)
def test_the_memory_launches_read_peaks_and_counts_per_engine_and_k(
    smoke: tuple[dict[str, Any], Path, Any],
) -> None:
    results = smoke[0]
    rows = {(r["variant"], r["k"]): r for r in results["memory"]}
    assert set(rows) == {(v, k) for v in SMOKE_SWEEP for k in (1, 2)}
    for (variant, k), row in rows.items():
        assert row["status"] == "ok", row["launch"]["error"]
        assert (
            0 < row["setup_peak_mb"] <= row["process_peak_mb"]
            and 0 < row["step_peak_mb"] <= row["process_peak_mb"]
        )
        if variant == "ddp_no_sync":
            assert row["records"] == {}  # a hand-written loop has no ledger
            continue
        rec = row["records"]
        assert rec["comm_rounds"] >= 1 and rec["comm_bytes"] > 0 and rec["time_s"] > 0
        if variant == "distaccum":
            assert rec["comm_rounds"] == 1 and rec["gather_calls"] == 0  # no_sync; replicated parameters
        if variant == "distaccum_fsdp":
            # FSDP2's default: each of the 3 units (Linear layers) is all-gathered for its forward and
            # again for its backward (resharded after forward), on every micro-batch.
            assert rec["gather_calls"] == 2 * 3 * k and rec["gather_bytes"] > 0
    assert {g["variant"] for g in report.memory_growth(results["memory"])} == set(SMOKE_SWEEP)


@pytest.mark.timeout(420)
def test_the_operators_are_counted_at_each_k(smoke: tuple[dict[str, Any], Path, Any]) -> None:
    ops = smoke[0]["host_ops"]
    assert set(ops) == {"1", "2"}
    for k, got in ops.items():
        assert got["k"] == int(k) and got["expert"]["names"]["aten::div"] == int(k)  # the loop's loss / total
        assert got["distaccum"]["ops"] > 0


@pytest.mark.timeout(420)
def test_the_smoke_run_renders_through_the_page_s_own_path(
    smoke: tuple[dict[str, Any], Path, Any], tmp_path: Path
) -> None:
    """results.md holds every part's table, printed as well as written; stored (into a folder of its own: a smoke
    run is refused for docs/results) and rendered into a copy of BENCHMARKS.md it fills the CPU sections."""
    _, out, proc = smoke
    markdown = (out / "results.md").read_text()
    assert "Smoke run" in markdown and markdown in proc.stdout
    for fragment in (
        "| case | K | rounds | distaccum / expert |",
        "| case | variant | engine | sync | step peak |",
        "| K | expert loop | distaccum | difference |",
        "Same work:",
        "Regression guard",
    ):
        assert fragment in markdown, fragment
    doc, store = tmp_path / "BENCHMARKS.md", tmp_path / "stored"
    doc.write_text((ROOT / "BENCHMARKS.md").read_text())
    assert (
        report.main(["--store", str(out / "results.json"), "--results-dir", str(store), "--doc", str(doc)])
        == 0
    )
    text = doc.read_text()
    for section in ("cpu-timing", "cpu-memory", "host-ops"):
        begin, end = report.markers(section)
        assert "Not measured" not in text[text.index(begin) : text.index(end)], section
    assert report.main(["--store", str(out / "results.json"), "--doc", str(doc), "--check"]) == 1  # refused


@pytest.mark.timeout(120)
def test_a_time_budget_runs_whole_cycles_of_one_step_blocks(tmp_path: Path) -> None:
    """``--block-steps 1 --budget-s 2``: each variant's block is one optimizer step, and the launch runs whole
    Williams cycles of rounds (6 for three variants) until two seconds have passed, far below the cap."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--ks",
            "1",
            "--sweep",
            "none",
            "--ops",
            "none",
            "--block-steps",
            "1",
            "--budget-s",
            "2",
            "--rounds",
            "100000",
            "--out",
            str(tmp_path),
            "--variants",
            "ddp_no_sync,distaccum,ddp_no_sync_twin",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = json.loads((tmp_path / "results.json").read_text())["timing"]
    assert row["steps_per_block"] == 1 and 6 < row["rounds"] < 100000 and row["rounds"] % 6 == 0
    assert len(row["orders"]) == row["rounds"]
    assert all(len(v["round_s"]) == row["rounds"] for v in row["variants"].values())
    assert len(row["ratios"]["A/A: expert twin / expert"]["per_round"]) == row["rounds"]
    assert "whole cycles of rounds for 2 s per launch" in (tmp_path / "results.md").read_text()


@pytest.mark.timeout(120)
def test_sigterm_stops_the_run_and_its_ranks(tmp_path: Path) -> None:
    """A `timeout` or an ending lease sends SIGTERM to benchmarks.run only: its ranks run in their own sessions,
    so the run must kill them on the way out, not leave them training (holding a GPU) after it exits."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "benchmarks.run",
            "--smoke",
            "--sweep",
            "none",
            "--ops",
            "none",
            "--device",
            "cpu",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    ranks: list[psutil.Process] = []
    deadline = time.monotonic() + 60
    while len(ranks) < 2 and time.monotonic() < deadline:  # the first launch's two ranks
        ranks = [
            c
            for c in psutil.Process(proc.pid).children(recursive=True)
            if "benchmarks.workers" in c.cmdline()
        ]
        time.sleep(0.1)
    assert len(ranks) == 2, "the first timing launch did not start"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, [p.pid for p in alive]


@pytest.mark.timeout(180)
def test_the_gpu_check_script_runs_every_stage_and_refuses_without_cuda(tmp_path: Path) -> None:
    """benchmarks/gpu_check.sh, the one command for a lent GPU: refused at once by an interpreter that lacks the
    requirements; without CUDA its benchmark stages refuse (exit 2) and the gpu tier skips, so the script itself is
    run here."""
    script = ROOT / "benchmarks" / "gpu_check.sh"
    refused = subprocess.run(
        ["bash", str(script), str(tmp_path / "refused")],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHON": "false"},
    )
    assert refused.returncode == 2 and "cannot import torch, hydra and omegaconf" in refused.stderr, refused
    assert not (tmp_path / "refused").exists()  # refused before any stage ran
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the script itself, it takes minutes")
    proc = subprocess.run(
        ["bash", str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=170,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "gpu tests: exit 0" in proc.stdout and "benchmark: exit 2" in proc.stdout, proc.stdout
    assert "memory sweep: exit 2" in proc.stdout, proc.stdout
    assert "CUDA is not available" in (tmp_path / "bench.log").read_text()


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mode_times_with_cuda_events_and_reads_the_allocator_s_peak(tmp_path: Path) -> None:
    smoke = [sys.executable, "-m", "benchmarks.run", "--smoke", "--device", "cuda"]
    proc = subprocess.run(
        [*smoke, "--sweep", "ddp_no_sync,distaccum", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    meta = results["meta"]
    assert (
        meta["backend"] == "nccl"
        and meta["world_size"] == torch.cuda.device_count()
        and meta["device"] == "cuda"
    )
    assert all(
        r["status"] == "ok" and r["variants"]["distaccum"]["step_s"]["median"] > 0 for r in results["timing"]
    )
    assert all(r["status"] == "ok" for r in results["memory"]) and results["host_ops"] == {}  # ops: CPU only
    assert "peak CUDA memory allocated" in (tmp_path / "results.md").read_text()
