"""The gradient noise scale monitor: the two-batch-size estimator, its smoothing, and — on a toy
regression trained with frozen weights by two DDP ranks — agreement with a direct computation from
per-sample gradients: every step exactly (the normalization), and on average the true B_simple of the
data (the estimator)."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, forked_torchrun
from distaccum.telemetry.gns import estimate, record_fields

sys.path.insert(0, str(REPO / "tests" / "fixtures"))
import gns_task  # noqa: E402


@pytest.mark.unit
@pytest.mark.parametrize("counts", [(32, 32), (20, 44), (7, 1, 30)])
def test_estimator_recovers_trace_and_squared_gradient_from_expected_norms(counts: tuple[int, ...]) -> None:
    g2, trace = 2.5, 40.0
    world, n_total = len(counts), sum(counts)
    # E|G_n|^2 = |G|^2 + tr(Sigma)/n, arranged as the ranks' all-reduced window_terms
    sums = [
        sum(g2 + trace / n for n in counts),
        sum(1 / n for n in counts),
        world * (g2 + trace / n_total) * n_total**2,
    ]
    got_g2, got_trace = estimate(sums, n_total, world)
    assert math.isclose(got_g2, g2, rel_tol=1e-12) and math.isclose(got_trace, trace, rel_tol=1e-12)
    assert all(math.isnan(v) for v in estimate([3.0, 1 / 8, 3.0 * 64], 8.0, 1))  # one rank: undefined


@pytest.mark.unit
def test_smoothing_is_a_ratio_of_moving_averages_that_survives_resume() -> None:
    values = [(1.0, 10.0), (2.0, 30.0), (float("nan"), float("nan")), (0.5, 5.0)]
    records: list[dict] = []
    for g2, trace in values:
        records.append(record_fields(g2, trace, records[-1] if records else None, 0.9))
    ema_sq = ema_tr = 0.0
    for g2, trace in (v for v in values if math.isfinite(v[0])):
        ema_sq, ema_tr = 0.9 * ema_sq + 0.1 * g2, 0.9 * ema_tr + 0.1 * trace
    assert math.isclose(records[-1]["gns_smoothed"], ema_tr / ema_sq) and records[1]["gns"] == 15.0
    assert records[2]["gns_trace_ema"] == records[1]["gns_trace_ema"]  # an undefined step changes nothing
    resumed = record_fields(
        0.5, 5.0, json.loads(json.dumps(records[2])), 0.9
    )  # as restored from metrics.jsonl
    assert resumed == records[-1]


def per_sample_gradients() -> torch.Tensor:
    """D x P matrix of the per-sample gradients of the toy task at its (frozen) initial weights."""
    from torch.func import functional_call, grad, vmap

    from distaccum.components import build_model
    from distaccum.engines.base import Precision

    model = build_model(gns_task.make_model, gns_task.SEED, Precision.of("fp64"), None, "gns_task")
    data = gns_task.dataset()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((functional_call(model, p, (x[None],)) - y[None]) ** 2).sum()  # the mse loss of one sample

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, data.x.double(), data.y.double())
    return torch.cat([g.reshape(len(data), -1) for g in grads.values()], dim=1)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("gns") / "run"
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")},
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = forked_torchrun(
        str(REPO / "tests" / "fixtures" / "gns_task.py"),
        str(run_dir),
        cwd=run_dir.parent,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return run_dir


@pytest.fixture(scope="module")
def trained(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
def test_every_step_matches_the_direct_computation(trained: list[dict]) -> None:
    from distaccum.config import Split
    from distaccum.data.global_batch import GlobalBatchOrder

    grads = per_sample_gradients()
    split = Split(gns_task.MICRO, gns_task.ACCUM, gns_task.WORLD)
    plan = GlobalBatchOrder(len(grads), split.global_batch, seed=gns_task.SEED)
    assert len(trained) == gns_task.STEPS
    for record in trained:
        window = plan.window(record["step"] - 1)
        ranks = [torch.cat(window.rank_micro_batches(split, r)) for r in range(split.world_size)]
        small = [float(grads[i].mean(0).square().sum()) for i in ranks]  # |G_r|^2, rank r's mean gradient
        big = float(grads[window.indices].mean(0).square().sum())  # |G_N|^2, the reduced one
        inv_small, inv_big = statistics.mean(1 / len(i) for i in ranks), 1 / len(window.indices)
        trace = (statistics.mean(small) - big) / (inv_small - inv_big)
        assert math.isclose(record["gns_trace"], trace, rel_tol=1e-9), record["step"]
        assert math.isclose(record["gns_grad_sq"], big - trace * inv_big, rel_tol=1e-9), record["step"]


@pytest.mark.dist
def test_the_estimate_agrees_with_the_noise_scale_of_the_data(trained: list[dict]) -> None:
    grads = per_sample_gradients()
    n = len(grads)
    mean_grad = grads.mean(0)
    g2 = float(mean_grad.square().sum())
    trace = float((grads - mean_grad).square().sum(1).mean())  # tr(Sigma) over the whole data set
    # The plan draws each window without replacement from the n samples: the two-size estimator then
    # has expectation tr(Sigma) n/(n-1) and |G|^2 - tr(Sigma)/(n-1) (the finite-population terms).
    want_trace, want_g2 = trace * n / (n - 1), g2 - trace / (n - 1)
    traces, sqs = [r["gns_trace"] for r in trained], [r["gns_grad_sq"] for r in trained]
    se_trace = statistics.stdev(traces) / math.sqrt(len(traces))
    se_g2 = statistics.stdev(sqs) / math.sqrt(len(sqs))
    assert abs(statistics.mean(traces) - want_trace) <= 3 * se_trace
    assert abs(statistics.mean(sqs) - want_g2) <= 3 * se_g2
    b_simple = trace / g2
    assert abs(statistics.mean(traces) / statistics.mean(sqs) - b_simple) <= 0.1 * b_simple
    # gns_smoothed (decay 0.95) has the variance of a 39-step mean: ~10% standard error here, so 3.5 SE
    assert abs(trained[-1]["gns_smoothed"] - b_simple) <= 0.35 * b_simple


@pytest.mark.dist
def test_report_plots_the_noise_scale(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from distaccum.cli.report import report_main

    assert report_main([str(run_dir), "--out", str(tmp_path)]) == 0
    assert "## Gradient noise scale" in capsys.readouterr().out
    png = (tmp_path / "report.png").read_bytes()
    assert (
        int.from_bytes(png[16:20], "big") == 3 * 6 * 110
    )  # three 6-inch panels at 110 dpi: the noise scale added (one run: no agreement panel)


@pytest.mark.unit
@pytest.mark.usefixtures("cpu_group")
def test_a_lagged_record_gets_its_own_step_s_terms() -> None:
    """Under the loop's lagged records (CUDA) step 1's fields are asked for after step 2's ``after_step``: each
    step's all-reduced terms are kept per step, so the record of step 1 is computed from step 1's gradients."""
    from distaccum.telemetry.gns import GnsMonitor, GradSquares

    class Window:
        def __init__(self, items: float) -> None:
            self.rank_sums = [(0.0, items), (0.0, items)]  # each rank's (loss sum, item count)

    def step(monitor: GnsMonitor, squares: GradSquares, k: int, scale: float) -> None:
        squares.add_local(torch.full((4,), scale))
        squares.add_reduced(torch.full((4,), scale / 2))
        monitor.after_step(k, Window(8.0 * k), 1.0, 1.0)

    def records(lagged: bool) -> list[dict[str, float]]:
        squares = GradSquares()
        monitor, out = GnsMonitor(squares, 0.5, world_size=2, rank=0, device=torch.device("cpu")), []
        step(monitor, squares, 1, 1.0)
        if lagged:
            step(monitor, squares, 2, 3.0)
        out.append(monitor.fields({"step": 1, "items": 64}, None, []))
        if not lagged:
            step(monitor, squares, 2, 3.0)
        out.append(monitor.fields({"step": 2, "items": 128}, None, out))
        return out

    synchronous, lagged = records(False), records(True)
    assert synchronous == lagged and all(math.isfinite(r["gns"]) for r in lagged) and lagged[0] != lagged[1]
