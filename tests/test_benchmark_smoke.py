"""The CI size of the benchmark, end to end on gloo: structure and counts, never timings."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from benchmarks.launch import ROOT
from benchmarks.run import SMOKE_SWEEP
from benchmarks.stats import ISSUE_RATIOS
from benchmarks.variants import DEFAULT_VARIANTS

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("bench")
    # DeepSpeed compiles its CPU op on first use in a checkout (~40 s, once): hence the generous limit.
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    assert (out / "results.json").exists(), proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text(), proc


@pytest.mark.timeout(420)
def test_every_variant_is_timed_in_every_round_of_one_launch(smoke: tuple[dict[str, Any], str, Any]) -> None:
    results, _, proc = smoke
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert [(r["case"], r["k"]) for r in results["timing"]] == [("smoke", 1), ("smoke", 2)]
    assert results["finished"] is True and results["settings"]["precision"] == "fp32"
    for row in results["timing"]:
        assert row["status"] == "ok", row["launch"]["error"]
        assert set(row["variants"]) == set(DEFAULT_VARIANTS)
        assert len(row["orders"]) == row["rounds"] == 2 and row["orders"][0] != row["orders"][1]  # rotated
        for name, v in row["variants"].items():
            assert len(v["round_s"]) == 2 and all(t > 0 for t in v["round_s"]), name
        for label in (*ISSUE_RATIOS, "every_micro / no_sync"):
            ratio = row["ratios"][label]
            assert all(math.isfinite(x) and x > 0 for x in ratio["per_round"]), label
            assert ratio["min"] <= ratio["q1"] <= ratio["median"] <= ratio["q3"] <= ratio["max"]


@pytest.mark.timeout(120)
def test_a_time_budget_runs_whole_cycles_of_one_step_blocks(tmp_path: Path) -> None:
    """``--block-steps 1 --budget-s 2``: each variant's block is one optimizer step, and the launch runs whole
    Williams cycles of rounds (6 for three variants) until two seconds have passed, far below the cap."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--ks", "1", "--sweep", "none",
                           "--block-steps", "1", "--budget-s", "2", "--rounds", "100000", "--out", str(tmp_path),
                           "--variants", "ddp_no_sync,distaccum,ddp_no_sync_twin"], cwd=ROOT, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (row,) = json.loads((tmp_path / "results.json").read_text())["timing"]
    assert row["steps_per_block"] == 1 and 6 < row["rounds"] < 100000 and row["rounds"] % 6 == 0
    assert len(row["orders"]) == row["rounds"]
    assert all(len(v["round_s"]) == row["rounds"] for v in row["variants"].values())
    assert len(row["ratios"]["A/A: no_sync twin / no_sync"]["per_round"]) == row["rounds"]
    assert f"whole cycles of rounds for 2 s per launch: {row['rounds']}-{row['rounds']} rounds" in \
        (tmp_path / "results.md").read_text()


@pytest.mark.timeout(420)
def test_variants_train_the_same_model_on_the_same_data(smoke: tuple[dict[str, Any], str, Any]) -> None:
    results, _, _ = smoke
    for row in results["timing"]:
        diffs = row["param_rel_diff"]
        for name in ("distaccum", "accelerate", "ddp_every_micro"):
            assert diffs[name] < 1e-5, (row["k"], name, diffs[name])
        # The floor averages nothing over ranks: it must train something else (a negative control).
        assert diffs["compute_floor"] > 1e-4


@pytest.mark.timeout(180)
def test_the_window_over_gloo_trains_the_same_model_bit_for_bit(tmp_path: Path) -> None:
    """The diagnostic ``distaccum_gloo_window`` (the CPU window's rows through gloo's all-gather instead of the
    run's Unix sockets) carries the same rows, so it trains exactly what distaccum and the expert loop train, and its
    ratios are reported."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--sweep", "none", "--rounds", "2",
                           "--out", str(tmp_path), "--variants", "ddp_no_sync,distaccum,distaccum_gloo_window"],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = json.loads((tmp_path / "results.json").read_text())["timing"]
    assert [r["k"] for r in rows] == [1, 2]
    for row in rows:
        assert row["status"] == "ok" and row["param_rel_diff"]["distaccum_gloo_window"] == 0.0, row["k"]
        for label in ("window: gloo / sockets", "window over gloo: distaccum / no_sync"):
            assert len(row["ratios"][label]["per_round"]) == 2, label


@pytest.mark.timeout(420)
def test_engine_sweep_reads_counts_and_peaks_per_engine_and_k(smoke: tuple[dict[str, Any], str, Any]) -> None:
    results, _, _ = smoke
    rows = {(r["variant"], r["k"]): r for r in results["sweep"]}
    assert set(rows) == {(v, k) for v in SMOKE_SWEEP for k in (1, 2)}
    for (variant, k), row in rows.items():
        assert row["status"] == "ok", row["launch"]["error"]
        assert 0 < row["setup_peak_mb"] <= row["process_peak_mb"] and 0 < row["step_peak_mb"] <= row["process_peak_mb"]
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
    assert {m["variant"] for m in results["memory"]} == set(SMOKE_SWEEP)
    assert all(m["k_low"] == 1 and m["k_high"] == 2 and m["step_growth"] > 0 for m in results["memory"])


@pytest.mark.timeout(420)
def test_results_md_has_the_issue_table(smoke: tuple[dict[str, Any], str, Any]) -> None:
    _, markdown, proc = smoke
    assert "| case | K | " + " | ".join(ISSUE_RATIOS) + " |" in markdown
    assert "Smoke run" in markdown and "Memory flat in K" in markdown and "GPU: not measured" in markdown
    assert markdown in proc.stdout  # printed as well as written


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mode_times_with_cuda_events_and_reports_mfu_and_bus_bandwidth(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--device", "cuda", "--sweep",
                           "ddp_no_sync,distaccum", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=580)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["backend"] == "nccl" and results["settings"]["world_size"] == torch.cuda.device_count()
    gpu = results["gpu"]
    assert {(r["variant"], r["k"]) for r in gpu["mfu"]} == {(v, k) for v in DEFAULT_VARIANTS for k in (1, 2)}
    assert all(r["step_ms"] > 0 and (r["mfu"] is None or 0 < r["mfu"] < 1) for r in gpu["mfu"])
    expected = "ok" if torch.cuda.device_count() > 1 else "not measured"
    assert [b["status"] for b in gpu["busbw"]] == [expected, expected]
    assert all(r["status"] == "ok" for r in results["sweep"])  # CUDA allocator peaks instead of RSS


@pytest.mark.timeout(180)
def test_the_fixed_cost_tool_prices_each_part_per_rank_and_round(tmp_path: Path) -> None:
    """``benchmarks.fixed_cost`` at the CI size: every variant measured in every round on both ranks, CPU and
    wall time per step positive, and the differences that price the window all-reduce and the rest printed."""
    record = tmp_path / "fixed_cost.json"
    variants = ["ddp_python_hook", "ddp_window_allreduce", "ddp_window_allgather", "distaccum"]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fixed_cost", "--steps", "20", "--rounds", "2",
                           "--variants", ",".join(variants), "--json", str(record)], cwd=ROOT, capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    blocks = json.loads(record.read_text())["blocks"]
    assert list(blocks) == variants
    for name, rounds in blocks.items():
        assert len(rounds) == 2 and all(len(ranks) == 2 for ranks in rounds), name
        for cpu_ms, wall_ms, switches, faults in (row for ranks in rounds for row in ranks):
            assert cpu_ms > 0 and wall_ms > 0 and switches >= 0 and faults >= 0, name
    for line in ("| ddp_window_allreduce - ddp_python_hook |", "| ddp_window_allgather - ddp_python_hook |",
                 "| distaccum - ddp_window_allgather |", "| distaccum - ddp_python_hook |"):  # the expert-loop row needs ddp_no_sync, not run here
        assert line in proc.stdout


@pytest.mark.timeout(180)
def test_the_fixed_cost_tool_times_every_piece_of_distaccum_s_step(tmp_path: Path) -> None:
    """``--sections``: every piece in ``PIECES`` exists (a renamed function fails the wrap) and the ones on the
    K = 1 step path ran once per step, with positive times; with two distaccum variants, each is timed in its own
    blocks (the device-totals diagnostic ran the device kind, distaccum the CPU's) and both get a group column."""
    record = tmp_path / "sections.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.fixed_cost", "--sections", "--steps", "10", "--rounds",
                           "2", "--variants", "distaccum,distaccum_device_totals", "--json", str(record)],
                          cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    pieces = json.loads(record.read_text())["pieces"]
    for label in ("HostTotals.reduce", "HostTotals.read", "ReplicatedEngine.step", "replicated.normalize_",
                  "Fingerprint.after_reduction", "MultiSink.log", "StepTimer.finish_step", "PendingTimes.resolve",
                  "SGD.step"):
        wall_us, cpu_us, calls = pieces["distaccum"][label]
        assert calls == 1.0 and wall_us > 0 and cpu_us >= 0, label
    assert pieces["distaccum_device_totals"]["DeviceTotals.reduce"][2] == 1.0
    assert pieces["distaccum_device_totals"]["HostTotals.reduce"][2] == 0.0
    assert pieces["distaccum"]["DeviceTotals.reduce"][2] == 0.0
    assert "| HostTotals.reduce |" in proc.stdout
    assert "| group | distaccum | distaccum_device_totals | share |" in proc.stdout
    assert "| all of distaccum's own pieces |" in proc.stdout


@pytest.mark.timeout(120)
def test_sigterm_stops_the_run_and_its_ranks(tmp_path: Path) -> None:
    """A `timeout` or an ending lease sends SIGTERM to benchmarks.run only: its ranks run in their own sessions,
    so the run must kill them on the way out, not leave them training (holding a GPU) after it exits."""
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.run", "--smoke", "--sweep", "none", "--device", "cpu",
                             "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ranks: list[psutil.Process] = []
    deadline = time.monotonic() + 60
    while len(ranks) < 2 and time.monotonic() < deadline:  # the first launch's two ranks
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if "benchmarks.interleave" in c.cmdline()]
        time.sleep(0.1)
    assert len(ranks) == 2, "the first timing launch did not start"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    gone, alive = psutil.wait_procs(ranks, timeout=10)
    assert not alive, [p.pid for p in alive]


@pytest.mark.timeout(180)
def test_the_gpu_check_script_runs_and_names_what_exists(tmp_path: Path) -> None:
    """benchmarks/gpu_check.sh (the one command for a lent GPU) names real cases, variants and test files;
    without CUDA its benchmark refuses (exit 2) and the gpu tier skips, so the script itself is checked here."""
    from benchmarks.cases import FULL_CASES, GPU_CASES
    from benchmarks.variants import check_variants

    script = ROOT / "benchmarks" / "gpu_check.sh"
    text = script.read_text()
    assert all((ROOT / path).is_file() for path in re.findall(r"tests/\S+\.py", text))
    match = re.search(r"cases=\$\{2:-([^}]+)\}", text)
    assert match and set(match.group(1).split(",")) == {c.name for c in (*FULL_CASES, *GPU_CASES)}
    named = [names for names in re.findall(r"(?:--sweep |variants=\$\{VARIANTS:-)([\w,]+)", text) if "," in names]
    assert len(named) == 2 and '--variants "$variants"' in text  # the timing's variants and the engine sweep's
    for names in named:
        check_variants(names.split(","))
    refused = subprocess.run(["bash", str(script), str(tmp_path / "refused")], capture_output=True, text=True,
                             timeout=30, env={**os.environ, "PYTHON": "false"})  # an interpreter without them
    assert refused.returncode == 2 and "cannot import torch, hydra and omegaconf" in refused.stderr, refused
    assert not (tmp_path / "refused").exists()  # refused before any stage ran
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run the script itself, it takes minutes")
    proc = subprocess.run(["bash", str(script), str(tmp_path)], capture_output=True, text=True, timeout=170,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "benchmark: exit 2" in proc.stdout and "gpu tests: exit 0" in proc.stdout, proc.stdout
    assert "engine sweep: exit 2" in proc.stdout, proc.stdout
    assert "CUDA is not available" in (tmp_path / "bench.log").read_text()


@pytest.mark.timeout(180)
def test_the_rss_maps_tool_finds_the_shard_fsdp2_every_micro_keeps_from_micro_batch_2(tmp_path: Path) -> None:
    """``benchmarks.rss_maps`` on the smoke model: a reading at every micro-batch and after the step, per rank, the
    peaks table, and what BENCHMARKS.md explains FSDP2 ``every_micro``'s growth from K = 1 with: its parameters hold
    no gradient when micro-batch 1 starts and their reduced local shards when micro-batch 2 starts."""
    record = tmp_path / "maps.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rss_maps", "distaccum_fsdp_every_micro", "--case", "smoke",
                           "--ks", "1,2", "--json", str(record)], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = json.loads(record.read_text())
    for k in (1, 2):
        ranks = records[str(k)]["ranks"]
        assert len(ranks) == 2 and all([r["label"] for r in rank] == [f"micro {i + 1}" for i in range(k)]
                                       + ["after the step"] for rank in ranks)
        assert all(r["peak_kib"] > 0 and r["maps"] for rank in ranks for r in rank)
    for rank in records["2"]["ranks"]:
        held = [sum(n for _, n in r["gradients"]) for r in rank]
        assert held[0] == 0 and held[1] > 0
    assert "| 2 |" in proc.stdout and "the parameters' gradients" in proc.stdout


@pytest.mark.timeout(240)
def test_the_rss_maps_tool_finds_the_accumulator_zero2_every_micro_keeps_from_micro_batch_2(tmp_path: Path) -> None:
    """The same for ZeRO-2 ``every_micro``: DeepSpeed's window accumulator (``all_grad_tensors``) is empty when
    micro-batch 1 starts and holds this rank's partition of the reduced gradient when micro-batch 2 starts, inside
    a mapping the reading located."""
    record = tmp_path / "maps.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.rss_maps", "distaccum_zero2_every_micro", "--case",
                           "smoke", "--ks", "2", "--json", str(record)], cwd=ROOT, capture_output=True, text=True,
                          timeout=230)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = json.loads(record.read_text())
    for rank in records["2"]["ranks"]:
        assert not rank[0]["accumulator"] and rank[1]["accumulator"]
    assert "the accumulator" in proc.stdout and ", in mapping 0x" in proc.stdout
