"""The loop in-process on a one-rank gloo group: per-step scheduler, clipping, fp16 skips, warnings."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distaccum.backend import make_backend
from distaccum.comm import CommLedger
from distaccum.config import RunConfig, from_mapping
from distaccum.data import build_dataset
from distaccum.models import build_model
from distaccum.optim import lr_factor
from distaccum.sinks import NullSink
from distaccum.train import TrainState, setup, train

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


def make_cfg(**sections: dict) -> RunConfig:
    base = {"model": {"name": "mlp", "width": 16}, "data": {"num_samples": 64},
            "trainer": {"nproc": 1, "max_steps": 4, "check_every": 0}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return from_mapping(base)


def prepare(cfg: RunConfig) -> tuple[TrainState, dict]:
    torch.manual_seed(cfg.trainer.seed)
    dataset = build_dataset(cfg.model, cfg.data)
    model, loss_fn = build_model(cfg.model, cfg.data)
    if cfg.precision == "fp64":
        model = model.double()
    ledger = CommLedger()
    split = cfg.split(1)
    state = setup(cfg, model, make_backend(cfg, torch.device("cpu"), ledger), split, dataset)
    return state, {"split": split, "dataset": dataset, "loss_fn": loss_fn, "ledger": ledger}


def run(cfg: RunConfig, state: TrainState | None = None, parts: dict | None = None) -> tuple[TrainState, list]:
    if state is None:
        state, parts = prepare(cfg)
    assert parts is not None
    records = train(cfg, state, parts["split"], parts["dataset"], parts["loss_fn"], parts["ledger"],
                    NullSink(), torch.device("cpu"), rank=0)
    return state, records


def params(state: TrainState) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for _, p in state.backend.full_parameters()])


def test_scheduler_and_optimizer_step_once_per_optimizer_step() -> None:
    cfg = make_cfg(accum={"micro_batch": 2, "steps": 4}, trainer={"max_steps": 5},
                   optim={"warmup_steps": 2, "schedule": "cosine"})
    state, parts = prepare(cfg)
    steps = []
    state.backend.optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    _, records = run(cfg, state, parts)
    assert len(steps) == 5 and state.scheduler.last_epoch == 5
    assert [r["micro_steps"] for r in records] == [4] * 5
    for r in records:  # the lr used at step s is the schedule's value at s, not at s * K
        assert r["lr"] == pytest.approx(cfg.optim.lr * lr_factor(r["step"] - 1, cfg.optim, 5), rel=1e-12)


def test_clipping_happens_once_on_the_accumulated_gradient() -> None:
    # Tiny clip norm: clipping per micro-batch (or before the sum) would change the update.
    results = []
    for micro, steps in ((16, 1), (4, 4), (1, 16)):
        cfg = make_cfg(accum={"micro_batch": micro, "steps": steps}, precision="fp64",
                       optim={"name": "sgd", "clip_norm": 0.05, "schedule": "constant", "warmup_steps": 0})
        state, parts = prepare(cfg)
        norms = []

        def record_norm(opt, args, kwargs, norms=norms):
            grads = [p.grad for group in opt.param_groups for p in group["params"]]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

        state.backend.optimizer.register_step_pre_hook(record_norm)
        _, records = run(cfg, state, parts)
        # clip_grad_norm_ scales by max_norm / (norm + 1e-6), hence the 1e-4 relative band.
        assert all(n == pytest.approx(0.05, rel=1e-4) for n in norms)  # clipped at the boundary
        assert all(r["grad_norm"] > 0.05 for r in records)  # the recorded norm is the pre-clip one
        results.append((params(state), [r["grad_norm"] for r in records]))
    for p, norms in results[1:]:
        assert torch.allclose(p, results[0][0], rtol=1e-12, atol=1e-14)
        assert norms == pytest.approx(results[0][1], rel=1e-10)


def test_fp16_overflow_skips_the_step_and_the_schedule() -> None:
    cfg = make_cfg(precision="fp16", accum={"micro_batch": 4, "steps": 2}, trainer={"max_steps": 10},
                   optim={"schedule": "linear", "warmup_steps": 0})
    state, parts = prepare(cfg)
    # A huge loss scale overflows fp16 activation gradients until the scaler backs off.
    state.backend.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    before = params(state).clone()
    state, records = run(cfg, state, parts)
    skipped = [r["skipped"] for r in records]
    assert skipped[0] and not skipped[-1], skipped
    assert state.scheduler.last_epoch == skipped.count(False)
    first_taken = skipped.index(False)
    assert records[first_taken]["lr"] == records[0]["lr"]  # skips did not advance the schedule
    assert not torch.equal(before, params(state))
    assert all(math.isfinite(r["loss"]) for r in records)


def test_batchnorm_with_accumulation_warns_and_names_layers() -> None:
    cfg = make_cfg(model={"name": "convnet_bn", "width": 4, "depth": 1}, accum={"micro_batch": 2, "steps": 4})
    with pytest.warns(UserWarning, match=r"batch-statistics layers \(features.1\)"):
        prepare(cfg)


def test_partial_window_is_weighted_by_what_it_holds() -> None:
    # 20 samples, global batch 16: step 2 holds 4 samples spread over 4 micro-batches of 1.
    losses = {}
    for micro, steps in ((16, 1), (4, 4)):
        cfg = make_cfg(accum={"micro_batch": micro, "steps": steps}, precision="fp64",
                       data={"num_samples": 20, "shuffle": False}, trainer={"max_steps": 2},
                       optim={"name": "sgd", "schedule": "constant", "warmup_steps": 0, "clip_norm": None})
        state, records = run(cfg)
        assert records[1]["partial_window"] and records[1]["samples"] == 4
        losses[(micro, steps)] = ([r["loss"] for r in records], params(state))
    (ref_loss, ref_p), (acc_loss, acc_p) = losses[(16, 1)], losses[(4, 4)]
    assert acc_loss == pytest.approx(ref_loss, rel=1e-12)
    assert torch.allclose(acc_p, ref_p, rtol=1e-12, atol=1e-14)


def test_checkpoint_between_windows_resumes_exactly(tmp_path: Path) -> None:
    from distaccum.checkpoint import StopFlag, StopRequested
    from distaccum.train import resume

    cfg = make_cfg(accum={"micro_batch": 2, "steps": 4}, precision="fp64", trainer={"max_steps": 6},
                   run_dir=str(tmp_path))
    straight, _ = run(cfg)

    state, parts = prepare(cfg)
    flag = StopFlag()
    stop_after = 3

    def request_stop(st: TrainState, record: dict) -> None:
        flag.requested = record["step"] == stop_after

    with pytest.raises(StopRequested) as stopped:
        train(cfg, state, parts["split"], parts["dataset"], parts["loss_fn"], parts["ledger"], NullSink(),
              torch.device("cpu"), rank=0, on_step=request_stop, stop=flag)
    assert stopped.value.step == stop_after  # 0-based index of the window that was NOT started
    assert (tmp_path / "checkpoint.pt").is_file()

    resumed, parts2 = prepare(cfg)
    assert resume(cfg, resumed) == stop_after and resumed.plan.next_step == stop_after
    resumed.records = list(state.records)
    resumed, records = run(cfg, resumed, parts2)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(params(resumed), params(straight))
