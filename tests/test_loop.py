"""The public Trainer in-process on a one-rank gloo group: per-step scheduler and clipping, fp16 skips,
batch-statistics warnings, partial windows, checkpoint/resume, the exactness of the power-of-two
scale, and memory flat in K (one collated micro-batch alive at a time)."""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from distaccum import losses
from distaccum.datasets import SyntheticImages, SyntheticRegression
from distaccum.models import MLP, ConvNetBN
from distaccum.optim import lr_factor
from distaccum.runtime.stopping import StopFlag, StopRequested
from distaccum.trainer import Trainer

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("cpu_group")]  # conftest: one gloo rank


def config(run_dir: Path, **sections: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "trainer": {"nproc": 1, "max_steps": 4, "check_every": 0, "save_final": False, "checkpoint_every": 0},
        "log": {"console": "quiet"},
        "run_dir": str(run_dir),
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def mlp_trainer(run_dir: Path, samples: int = 64, **sections: Any) -> Trainer:
    return Trainer(
        config(run_dir, **sections),
        model=lambda: MLP(32, 16, 2, 8),
        dataset=SyntheticRegression(samples),
        loss=losses.mse,
    )


def params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for _, p in trainer.state.engine.full_parameters()])


SGD = {"name": "sgd", "schedule": "constant", "warmup_steps": 0, "clip_norm": None}


def test_scheduler_and_optimizer_step_once_per_optimizer_step(tmp_path: Path) -> None:
    trainer = mlp_trainer(
        tmp_path,
        accum={"micro_batch": 2, "steps": 4},
        trainer={"max_steps": 5},
        optim={"warmup_steps": 2, "schedule": "cosine"},
    )
    state = trainer.setup()
    steps: list[int] = []
    state.engine.optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    trainer.fit()
    records = state.records
    assert len(steps) == 5 and state.scheduler.last_epoch == 5
    assert [r["micro_steps"] for r in records] == [4] * 5
    for r in records:  # the lr used at step s is the schedule's value at s, not at s * K
        assert r["lr"] == pytest.approx(
            trainer.cfg.optim.lr * lr_factor(r["step"] - 1, trainer.cfg.optim, 5), rel=1e-12
        )


def test_clipping_happens_once_on_the_accumulated_gradient(tmp_path: Path) -> None:
    # Tiny clip norm: clipping per micro-batch (or before the sum) would change the update.
    results = []
    for micro, steps in ((16, 1), (4, 4), (1, 16)):
        trainer = mlp_trainer(
            tmp_path / f"{micro}",
            accum={"micro_batch": micro, "steps": steps},
            precision="fp64",
            optim={**SGD, "clip_norm": 0.05},
        )
        state = trainer.setup()
        norms: list[float] = []

        def record_norm(opt, args, kwargs, norms=norms):
            grads = [p.grad for group in opt.param_groups for p in group["params"]]
            norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

        state.engine.optimizer.register_step_pre_hook(record_norm)
        trainer.fit()
        # torch's clip coefficient is max_norm / (norm + 1e-6), hence the 1e-4 relative band.
        assert all(n == pytest.approx(0.05, rel=1e-4) for n in norms)  # clipped at the boundary
        assert all(r["grad_norm"] > 0.05 for r in state.records)  # the recorded norm is the pre-clip one
        results.append((params(trainer), [r["grad_norm"] for r in state.records]))
    for p, norms in results[1:]:
        assert torch.allclose(p, results[0][0], rtol=1e-12, atol=1e-14)
        assert norms == pytest.approx(results[0][1], rel=1e-10)


class FirstWindowOverflows:
    """``losses.mse``, times 2^40 in the first window: fp16 gradients overflow there, whatever the
    engine's loss scale, and the step must be skipped."""

    def __init__(self, accum_steps: int) -> None:
        self.left = accum_steps

    def __call__(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        summed, n = losses.mse(model, batch)
        self.left -= 1
        return (summed * 2.0**40 if self.left >= 0 else summed), n


def check_fp16_overflow_skip(run_dir: Path, engine: str, device: str) -> None:
    """One body for every engine that trains fp16 (CPU: DDP; CUDA: DDP, Accelerate): a skipped step
    leaves the parameters bit for bit, and the optimizer and the schedule count applied steps only."""
    k, steps = 2, 3
    trainer = Trainer(
        config(
            run_dir,
            precision="fp16",
            engine={"name": engine},
            accum={"micro_batch": 4, "steps": k},
            trainer={"max_steps": steps, "device": device},
            optim={"name": "adamw", "schedule": "linear", "warmup_steps": 0},
        ),
        model=lambda: MLP(32, 16, 2, 8),
        dataset=SyntheticRegression(64),
        loss=FirstWindowOverflows(k),
        check_components=False,
    )  # the probe would call the loss too
    state = trainer.setup()
    optimizer_steps: list[int] = []
    state.engine.optimizer.register_step_post_hook(lambda opt, args, kwargs: optimizer_steps.append(1))
    before = params(trainer).clone()
    for _ in range(steps):
        (record,) = trainer.train_steps(1)
        after = params(trainer).clone()
        assert record["skipped"] == torch.equal(before, after), record  # skipped <=> not one bit moved
        assert record["skipped"] != math.isfinite(record["grad_norm"]), record
        before = after
    skipped = [r["skipped"] for r in state.records]
    applied = skipped.count(False)
    assert skipped[0] and applied > 0, (
        skipped
    )  # the first window overflows by construction; the scaler recovers
    assert len(optimizer_steps) == applied and state.scheduler.last_epoch == applied
    adam_steps = {float(s["step"]) for s in state.engine.optimizer.state.values()}
    assert adam_steps == {float(applied)}, adam_steps  # AdamW's own step count (bias correction)
    assert (
        state.records[skipped.index(False)]["lr"] == state.records[0]["lr"]
    )  # skips left the schedule alone
    assert all(math.isfinite(r["loss"]) for r in state.records)
    trainer.finish()


def test_fp16_overflow_skips_the_step_and_the_schedule(tmp_path: Path) -> None:
    check_fp16_overflow_skip(tmp_path, "ddp", "cpu")


def test_batchnorm_with_accumulation_warns_and_names_layers(tmp_path: Path) -> None:
    trainer = Trainer(
        config(tmp_path, accum={"micro_batch": 2, "steps": 4}),
        model=lambda: ConvNetBN(width=4, depth=1),
        dataset=SyntheticImages(32),
        loss=losses.sample_cross_entropy,
    )
    with pytest.warns(UserWarning, match=r"batch-statistics layers \(features.1\)"):
        trainer.setup()


def test_partial_window_is_weighted_by_what_it_holds(tmp_path: Path) -> None:
    # 20 samples, global batch 16: step 2 holds 4 samples spread over 4 micro-batches of 1.
    results = {}
    for micro, steps in ((16, 1), (4, 4), (1, 16)):
        trainer = mlp_trainer(
            tmp_path / f"{micro}",
            samples=20,
            accum={"micro_batch": micro, "steps": steps},
            precision="fp64",
            data={"shuffle": False},
            trainer={"max_steps": 2},
            optim=SGD,
        )
        trainer.fit()
        records = trainer.state.records
        assert records[1]["partial_window"] and records[1]["samples"] == 4 and records[1]["items"] == 4
        results[micro] = ([r["loss"] for r in records], [r["grad_norm"] for r in records], params(trainer))
    ref_loss, ref_norm, ref_p = results[16]
    for micro in (4, 1):  # micro 1 x 16 steps: 12 of the partial window's 16 pieces are empty
        loss, norm, p = results[micro]
        assert loss == pytest.approx(ref_loss, rel=1e-12) and norm == pytest.approx(ref_norm, rel=1e-12)
        assert torch.allclose(p, ref_p, rtol=1e-12, atol=1e-14)


def test_checkpoint_between_windows_resumes_exactly(tmp_path: Path) -> None:
    straight = mlp_trainer(
        tmp_path / "straight",
        accum={"micro_batch": 2, "steps": 4},
        precision="fp64",
        trainer={"max_steps": 6},
    )
    straight.fit()

    flag = StopFlag()
    stop_after = 3

    def request_stop(state: Any, record: dict) -> None:
        # A request (SIGTERM) arriving during window 3 is seen when that window ends.
        flag.requested = flag.requested or record["step"] == stop_after - 1

    first = Trainer(
        config(
            tmp_path / "stopped",
            accum={"micro_batch": 2, "steps": 4},
            precision="fp64",
            trainer={"max_steps": 6},
        ),
        model=lambda: MLP(32, 16, 2, 8),
        dataset=SyntheticRegression(64),
        loss=losses.mse,
        stop=flag,
        on_step=request_stop,
    )
    with pytest.raises(StopRequested) as stopped:
        first.fit()
    assert stopped.value.step == stop_after
    assert (tmp_path / "stopped" / "checkpoints" / "step-00000003" / "manifest.json").is_file()

    resumed = mlp_trainer(
        tmp_path / "stopped", accum={"micro_batch": 2, "steps": 4}, precision="fp64", trainer={"max_steps": 6}
    )
    state = resumed.setup()
    assert state.source.next_step == stop_after and len(state.records) == stop_after
    resumed.fit()
    assert [r["step"] for r in state.records] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(params(resumed), params(straight))


def test_the_power_of_two_scale_never_changes_a_bit(tmp_path: Path) -> None:
    # loop.py claims: multiplying by c = 2^-k is exact, so whatever N_prev is, the result is the same.
    results = []
    for n_prev in (0.0, 3.0, 1e6):
        trainer = mlp_trainer(
            tmp_path / f"{n_prev}", accum={"micro_batch": 4, "steps": 4}, trainer={"max_steps": 1}
        )
        trainer.setup().n_prev = n_prev
        trainer.fit()
        results.append((params(trainer), trainer.state.records[0]["grad_norm"]))
    for p, norm in results[1:]:
        assert torch.equal(p, results[0][0]) and norm == results[0][1]


class Tracked:
    """Counts how many collated batches are alive."""

    alive = 0
    most_alive_at_forward = 0

    def __init__(self) -> None:
        Tracked.alive += 1

    def __del__(self) -> None:
        Tracked.alive -= 1


def tracked_collate(samples: list[Any]) -> dict[str, Any]:
    xs, ys = zip(*samples, strict=True)
    return {"inputs": torch.stack(xs), "targets": torch.stack(ys), "tracker": Tracked()}


def tracked_mse(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, int]:
    Tracked.most_alive_at_forward = max(Tracked.most_alive_at_forward, Tracked.alive)
    return losses.mse(model, batch)


def test_one_collated_micro_batch_is_alive_at_a_time(tmp_path: Path) -> None:
    # Memory flat in K, structurally: with K=16 each micro-batch is collated just before its forward
    # and released before the next one is, so inputs never pile up over the window.
    Tracked.alive = Tracked.most_alive_at_forward = 0
    trainer = Trainer(
        config(tmp_path, accum={"micro_batch": 2, "steps": 16}, trainer={"max_steps": 2}),
        model=lambda: MLP(32, 16, 2, 8),
        dataset=SyntheticRegression(64),
        loss=tracked_mse,
        collate=tracked_collate,
        check_components=False,
    )
    trainer.fit()
    assert len(trainer.state.records) == 2 and trainer.state.records[0]["micro_steps"] == 16
    assert Tracked.most_alive_at_forward == 1


def test_training_in_chunks_equals_one_fit(tmp_path: Path) -> None:
    whole = mlp_trainer(tmp_path / "whole", accum={"micro_batch": 2, "steps": 4}, trainer={"max_steps": 5})
    whole.fit()
    chunked = mlp_trainer(tmp_path / "chunks", accum={"micro_batch": 2, "steps": 4}, trainer={"max_steps": 5})
    first = chunked.train_steps(2)
    rest = chunked.train_steps()  # up to trainer.max_steps
    assert [r["step"] for r in first] == [1, 2] and [r["step"] for r in rest] == [3, 4, 5]
    assert torch.equal(params(chunked), params(whole))
    summary = chunked.finish()
    assert summary["steps"] == 5
    assert [r["loss"] for r in chunked.state.records] == [r["loss"] for r in whole.state.records]


def check_tensor_rows_train_as_the_dataloader(
    run_dir: Path, device: str, *, shuffle: bool = True, pinned: bool = False
) -> None:
    """One body for CPU and CUDA: a plain ``TensorDataset`` is cut in the training process (``TensorRows``, no
    DataLoader); a subclass of it goes through the DataLoader. Over a partial window and into the next epoch (50
    samples, global batch 8: the seventh window holds 2), stepped in chunks: the same records and parameters bit
    for bit."""
    from torch.utils.data import TensorDataset

    class ThroughTheLoader(TensorDataset):
        pass

    gen = torch.Generator().manual_seed(5)
    tensors = (torch.randn(50, 32, generator=gen), torch.randn(50, 8, generator=gen))
    if pinned:
        tensors = tuple(t.pin_memory() for t in tensors)
    runs = []
    for kind in (TensorDataset, ThroughTheLoader):
        trainer = Trainer(
            config(
                run_dir / kind.__name__,
                accum={"micro_batch": 2, "steps": 4},
                trainer={"max_steps": 9, "device": device},
                data={"shuffle": shuffle},
            ),
            model=lambda: MLP(32, 16, 2, 8),
            dataset=kind(*tensors),
            loss=squared_error,
        )
        trainer.train_steps(5)
        assert inspect.isgenerator(trainer.state.source._batches) is (
            kind is TensorDataset
        )  # TensorRows, or not
        trainer.train_steps()
        runs.append(
            (params(trainer), [(r["loss"], r["items"], r["partial_window"]) for r in trainer.state.records])
        )
    assert runs[0][1] == runs[1][1] and any(partial for _, _, partial in runs[0][1])
    assert torch.equal(runs[0][0], runs[1][0])


def test_a_loss_that_writes_into_its_in_memory_batch_stops_the_run_before_later_data_is_changed(
    tmp_path: Path,
) -> None:
    """An in-order ``TensorDataset``'s micro-batches are views of it: a loss that writes into its batch stops the
    run at the next micro-batch with :class:`DatasetWrittenError` naming the rows, after at most that one
    micro-batch's rows changed and before any step trained on changed data; shuffled, it trains (gathered
    rows: the dataset never sees the write)."""
    from torch.utils.data import TensorDataset

    from distaccum.data.pipeline import DatasetWrittenError

    def normalizing_in_place(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
        x, y = batch
        x.sub_(x.mean())  # what a careless loss does to its input
        return squared_error(model, (x, y))

    gen = torch.Generator().manual_seed(3)
    tensors = (torch.randn(48, 32, generator=gen), torch.randn(48, 8, generator=gen))
    for shuffle in (False, True):
        data = tuple(t.clone() for t in tensors)
        trainer = Trainer(
            config(tmp_path / str(shuffle), accum={"micro_batch": 4, "steps": 3}, data={"shuffle": shuffle}),
            model=lambda: MLP(32, 16, 2, 8),
            dataset=TensorDataset(*data),
            loss=normalizing_in_place,
        )
        if shuffle:
            assert len(trainer.train_steps()) == 4 and torch.equal(data[0], tensors[0])
            continue
        with pytest.raises(DatasetWrittenError, match=r"rows 0\.\.3 were a micro-batch in training"):
            trainer.train_steps()
        assert trainer.state.records == []  # no step ran on it
        assert torch.equal(data[0][4:], tensors[0][4:]) and not torch.equal(data[0][:4], tensors[0][:4])


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_in_memory_tensor_dataset_trains_bit_for_bit_as_through_the_dataloader(
    tmp_path: Path, shuffle: bool
) -> None:
    check_tensor_rows_train_as_the_dataloader(tmp_path, "cpu", shuffle=shuffle)


def test_window_totals_count_exactly_and_weigh_stand_ins_zero() -> None:
    """The window's totals (one rank): a real micro-batch adds its loss and item count exactly (a float32 loss is
    widened, never rounded; a count may be an int or a tensor); a stand-in sample (``samples`` 0) adds nothing to
    either and is backpropagated with weight 0, but a non-finite stand-in loss still shows (the window's check must
    see it); the scale is 1/(c N), NaN when a loss was not finite."""
    from conftest import one_rank_group
    from distaccum.window import WindowTotals

    with one_rank_group("cpu"):
        window = WindowTotals(torch.device("cpu"))
        tenth = torch.tensor(0.1, dtype=torch.float32)
        assert window.add(tenth, 4, 2) == 1.0
        assert window.add(torch.tensor(7, dtype=torch.float32), torch.tensor(3), 2) == 1.0
        assert window.add(torch.tensor(5.0), 2, 0) == 0.0
        window.reduce(stop=True, checkpoint=False)
        got = window.read()
        assert (got.loss_sum, got.items) == (float(tenth) + 7.0, 7.0)
        assert (got.items_min, got.items_max, got.bad_ranks, got.stop_votes, got.checkpoint_votes) == (
            0,
            4,
            [],
            1,
            0,
        )
        assert got.grad_scale(0.5) == 1.0 / (0.5 * 7.0) and got.grad_scale(0.5, "mean_per_micro") == 2.0
        window.start()
        window.add(torch.tensor(1.0), 3, 1)
        window.add(torch.tensor(float("inf")), 1, 0)
        window.reduce(stop=False, checkpoint=False)
        got = window.read()
        assert got.bad_ranks == [0] and got.items == 3.0 and math.isnan(got.grad_scale(1.0))


def test_a_count_tensor_changed_after_it_was_returned_is_refused() -> None:
    """The window reads its item counts once, after its last forward: a loss that hands back the same count buffer
    each time and overwrites it would otherwise be counted with its last value."""
    from conftest import one_rank_group
    from distaccum.window import WindowTotals

    with one_rank_group("cpu"):
        window = WindowTotals(torch.device("cpu"))
        reused = torch.tensor(5.0, dtype=torch.float64)
        window.add(torch.tensor(1.0), reused, 1)
        reused.fill_(9.0)
        window.add(torch.tensor(1.0), reused, 1)
        with pytest.raises(ValueError, match="changed it in place afterwards"):
            window.reduce(stop=False, checkpoint=False)


class RecordingSGD(torch.optim.SGD):
    """Plain SGD that keeps a copy of the gradients it steps with."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append([p.grad.clone() for group in self.param_groups for p in group["params"]])
        return super().step(closure)


def squared_error(model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel()  # 3 samples x 8 = 24 items


def test_the_step_normalizes_once_by_multiplying_the_reduced_sum(tmp_path: Path) -> None:
    """One normalization on every split: each micro-batch backpropagates its summed loss times the power of two c,
    the reduction sums, and the step multiplies the reduced gradient by fl(1/(c N)). At K = 1 the optimizer steps
    with bitwise that gradient (not with the loss multiplied by 1/N, which rounds differently here: N = 24); K = 3
    over the same samples agrees to fp32 rounding."""
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(3, 32, generator=gen), torch.randn(3, 8, generator=gen))
    seen, start = {}, {}
    for micro, k in ((3, 1), (1, 3)):
        optimizers: list[RecordingSGD] = []

        def make(params: Any, kept: list[RecordingSGD] = optimizers) -> RecordingSGD:
            kept.append(RecordingSGD(params, lr=0.1))
            return kept[-1]

        cfg = config(
            tmp_path / f"k{k}",
            optim=SGD,
            accum={"micro_batch": micro, "steps": k, "global_batch": None},
            data={"shuffle": False},
            trainer={"max_steps": 1},
            log={"grad_norm": False},
        )
        trainer = Trainer(
            cfg, model=lambda: MLP(32, 16, 2, 8), dataset=data, loss=squared_error, optimizer=make
        )
        trainer.setup()
        start[k] = [p.detach().clone() for _, p in trainer.state.engine.full_parameters()]
        trainer.train_steps(1)
        trainer.finish()
        seen[k] = optimizers[0].seen[0]
    assert all(torch.equal(a, b) for a, b in zip(start[1], start[3], strict=True))

    def by_hand(factor: Any, after: float | None) -> list[torch.Tensor]:
        model = MLP(32, 16, 2, 8)
        with torch.no_grad():
            for p, value in zip(model.parameters(), start[1], strict=True):
                p.copy_(value)
        summed, n = squared_error(model, data.tensors)
        (summed * factor).backward()
        return [p.grad if after is None else p.grad * after for p in model.parameters()]

    in_loss = by_hand(torch.tensor(1 / 24, dtype=torch.float64).float(), None)
    c = 2.0 ** -round(math.log2(3))  # power_of_two_scale before the first window (global batch 3)
    stepped = by_hand(c, 1 / (c * 24))
    assert not all(
        torch.equal(a, b) for a, b in zip(in_loss, stepped, strict=True)
    )  # the test tells them apart
    assert all(torch.equal(a, b) for a, b in zip(seen[1], stepped, strict=True))
    for a, b in zip(seen[1], seen[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_non_finite_loss_at_k1_skips_the_step_and_the_next_one_trains(tmp_path: Path) -> None:
    """A rank's NaN loss makes the window's 1/(c N) NaN and every gradient NaN: the step is skipped, and the next
    window (gradients zeroed in place) trains normally."""
    from distaccum import testing
    from distaccum.testing.faults import NanLoss

    testing.install(NanLoss(step=2))
    trainer = mlp_trainer(tmp_path, optim=SGD, accum={"micro_batch": 8, "steps": 1, "global_batch": None})
    trainer.setup()
    before = params(trainer)
    records = trainer.train_steps(4)
    trainer.finish()
    assert [r["skipped"] for r in records] == [False, True, False, False]
    assert math.isnan(records[1]["loss"]) and all(math.isfinite(r["loss"]) for r in records[2:])
    after = params(trainer)
    assert torch.isfinite(after).all() and not torch.equal(after, before)


def test_one_default_ddp_step_runs_in_four_library_files(tmp_path: Path) -> None:
    """Reading one default DDP step takes four library files: every distaccum function that runs inside
    ``train_step`` is in the loop, the window's totals, the engine protocol's module or the DDP engine, apart from
    the user's components (here built-in ones: the model, the dataset, the loss) and the objects the step is handed
    and calls through their interfaces: the window source and the timer that wraps it, the ledger the comm hook
    reports to, the scheduler, the votes (the checkpointer's, the fingerprint's) and the split's arithmetic."""
    import inspect
    import sys

    from distaccum import loop

    trainer = mlp_trainer(tmp_path, accum={"micro_batch": 2, "steps": 4}, trainer={"max_steps": 3})
    trainer.train_steps(1)  # DDP's first-step work out of the way
    run = trainer._run
    assert run is not None
    ran: set[str] = set()
    package = Path(loop.__file__).parent

    def profile(frame: Any, event: str, arg: Any) -> None:
        path = Path(frame.f_code.co_filename)
        if event == "call" and path.is_relative_to(package):
            ran.add(path.relative_to(package).as_posix())

    sys.setprofile(profile)
    try:
        loop.train_step(run.state, run.resolved.loop, run.loss, run.parts.totals, run.parts.votes)
    finally:
        sys.setprofile(None)
    components = {
        Path(inspect.getfile(obj)).relative_to(package).as_posix()
        for obj in (MLP, SyntheticRegression, losses.mse)
    }
    handed = {
        "telemetry/timing.py",
        "telemetry/ledger.py",
        "optim.py",
        "rundir/checkpoint.py",
        "guards/fingerprint.py",
        "split.py",
    }
    served = {f for f in ran if f.startswith("data/") or f in handed}
    assert components == {"models.py", "datasets.py", "losses.py"} and served, (components, served)
    served |= components
    assert ran - served == {"loop.py", "window.py", "engines/base.py", "engines/ddp.py"}, sorted(ran)
    trainer.finish()
