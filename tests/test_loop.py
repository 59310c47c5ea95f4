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
from distaccum.cluster.stopping import StopFlag, StopRequested
from distaccum.datasets import SyntheticImages, SyntheticRegression
from distaccum.models import MLP, ConvNetBN
from distaccum.optim import lr_factor
from distaccum.trainer import Trainer

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("cpu_group")]  # conftest: one gloo rank



def config(run_dir: Path, **sections: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"trainer": {"nproc": 1, "max_steps": 4, "check_every": 0, "save_final": False,
                                        "checkpoint_every": 0},
                            "log": {"console": "quiet"}, "run_dir": str(run_dir)}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return base


def mlp_trainer(run_dir: Path, samples: int = 64, **sections: Any) -> Trainer:
    return Trainer(config(run_dir, **sections), model=lambda: MLP(32, 16, 2, 8),
                   dataset=SyntheticRegression(samples), loss=losses.mse)


def params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for _, p in trainer.state.engine.full_parameters()])


SGD = {"name": "sgd", "schedule": "constant", "warmup_steps": 0, "clip_norm": None}


def test_scheduler_and_optimizer_step_once_per_optimizer_step(tmp_path: Path) -> None:
    trainer = mlp_trainer(tmp_path, accum={"micro_batch": 2, "steps": 4}, trainer={"max_steps": 5},
                          optim={"warmup_steps": 2, "schedule": "cosine"})
    state = trainer.setup()
    steps: list[int] = []
    state.engine.optimizer.register_step_post_hook(lambda opt, args, kwargs: steps.append(1))
    trainer.fit()
    records = state.records
    assert len(steps) == 5 and state.scheduler.last_epoch == 5
    assert [r["micro_steps"] for r in records] == [4] * 5
    for r in records:  # the lr used at step s is the schedule's value at s, not at s * K
        assert r["lr"] == pytest.approx(trainer.cfg.optim.lr * lr_factor(r["step"] - 1, trainer.cfg.optim, 5),
                                        rel=1e-12)


def test_clipping_happens_once_on_the_accumulated_gradient(tmp_path: Path) -> None:
    # Tiny clip norm: clipping per micro-batch (or before the sum) would change the update.
    results = []
    for micro, steps in ((16, 1), (4, 4), (1, 16)):
        trainer = mlp_trainer(tmp_path / f"{micro}", accum={"micro_batch": micro, "steps": steps}, precision="fp64",
                              optim={**SGD, "clip_norm": 0.05})
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
    trainer = Trainer(config(run_dir, precision="fp16", engine={"name": engine}, accum={"micro_batch": 4, "steps": k},
                             trainer={"max_steps": steps, "device": device},
                             optim={"name": "adamw", "schedule": "linear", "warmup_steps": 0}),
                      model=lambda: MLP(32, 16, 2, 8), dataset=SyntheticRegression(64), loss=FirstWindowOverflows(k),
                      check_components=False)  # the probe would call the loss too
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
    assert skipped[0] and applied > 0, skipped  # the first window overflows by construction; the scaler recovers
    assert len(optimizer_steps) == applied and state.scheduler.last_epoch == applied
    adam_steps = {float(s["step"]) for s in state.engine.optimizer.state.values()}
    assert adam_steps == {float(applied)}, adam_steps  # AdamW's own step count (bias correction)
    assert state.records[skipped.index(False)]["lr"] == state.records[0]["lr"]  # skips left the schedule alone
    assert all(math.isfinite(r["loss"]) for r in state.records)
    trainer.finish()


def test_fp16_overflow_skips_the_step_and_the_schedule(tmp_path: Path) -> None:
    check_fp16_overflow_skip(tmp_path, "ddp", "cpu")


def test_batchnorm_with_accumulation_warns_and_names_layers(tmp_path: Path) -> None:
    trainer = Trainer(config(tmp_path, accum={"micro_batch": 2, "steps": 4}),
                      model=lambda: ConvNetBN(width=4, depth=1), dataset=SyntheticImages(32),
                      loss=losses.sample_cross_entropy)
    with pytest.warns(UserWarning, match=r"batch-statistics layers \(features.1\)"):
        trainer.setup()


def test_partial_window_is_weighted_by_what_it_holds(tmp_path: Path) -> None:
    # 20 samples, global batch 16: step 2 holds 4 samples spread over 4 micro-batches of 1.
    results = {}
    for micro, steps in ((16, 1), (4, 4), (1, 16)):
        trainer = mlp_trainer(tmp_path / f"{micro}", samples=20, accum={"micro_batch": micro, "steps": steps},
                              precision="fp64", data={"shuffle": False}, trainer={"max_steps": 2}, optim=SGD)
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
    straight = mlp_trainer(tmp_path / "straight", accum={"micro_batch": 2, "steps": 4}, precision="fp64",
                           trainer={"max_steps": 6})
    straight.fit()

    flag = StopFlag()
    stop_after = 3

    def request_stop(state: Any, record: dict) -> None:
        # A request (SIGTERM) arriving during window 3 is seen when that window ends.
        flag.requested = flag.requested or record["step"] == stop_after - 1

    first = Trainer(config(tmp_path / "stopped", accum={"micro_batch": 2, "steps": 4}, precision="fp64",
                           trainer={"max_steps": 6}),
                    model=lambda: MLP(32, 16, 2, 8), dataset=SyntheticRegression(64), loss=losses.mse,
                    stop=flag, on_step=request_stop)
    with pytest.raises(StopRequested) as stopped:
        first.fit()
    assert stopped.value.step == stop_after
    assert (tmp_path / "stopped" / "checkpoints" / "step-00000003" / "manifest.json").is_file()

    resumed = mlp_trainer(tmp_path / "stopped", accum={"micro_batch": 2, "steps": 4}, precision="fp64",
                          trainer={"max_steps": 6})
    state = resumed.setup()
    assert state.source.next_step == stop_after and len(state.records) == stop_after
    resumed.fit()
    assert [r["step"] for r in state.records] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(params(resumed), params(straight))


def test_the_power_of_two_scale_never_changes_a_bit(tmp_path: Path) -> None:
    # loop.py claims: multiplying by c = 2^-k is exact, so whatever N_prev is, the result is the same.
    results = []
    for n_prev in (0.0, 3.0, 1e6):
        trainer = mlp_trainer(tmp_path / f"{n_prev}", accum={"micro_batch": 4, "steps": 4},
                              trainer={"max_steps": 1})
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
    trainer = Trainer(config(tmp_path, accum={"micro_batch": 2, "steps": 16}, trainer={"max_steps": 2}),
                      model=lambda: MLP(32, 16, 2, 8), dataset=SyntheticRegression(64), loss=tracked_mse,
                      collate=tracked_collate, check_components=False)
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


def check_tensor_rows_train_as_the_dataloader(run_dir: Path, device: str, *, shuffle: bool = True,
                                             pinned: bool = False) -> None:
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
        trainer = Trainer(config(run_dir / kind.__name__, accum={"micro_batch": 2, "steps": 4},
                                 trainer={"max_steps": 9, "device": device}, data={"shuffle": shuffle}),
                          model=lambda: MLP(32, 16, 2, 8), dataset=kind(*tensors), loss=squared_error)
        trainer.train_steps(5)
        assert inspect.isgenerator(trainer.state.source._batches) is (kind is TensorDataset)  # TensorRows, or not
        trainer.train_steps()
        runs.append((params(trainer), [(r["loss"], r["items"], r["partial_window"]) for r in trainer.state.records]))
    assert runs[0][1] == runs[1][1] and any(partial for _, _, partial in runs[0][1])
    assert torch.equal(runs[0][0], runs[1][0])


def test_a_loss_that_writes_into_its_in_memory_batch_stops_the_run_before_later_data_is_changed(
        tmp_path: Path) -> None:
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
        trainer = Trainer(config(tmp_path / str(shuffle), accum={"micro_batch": 4, "steps": 3},
                                 data={"shuffle": shuffle}),
                          model=lambda: MLP(32, 16, 2, 8), dataset=TensorDataset(*data), loss=normalizing_in_place)
        if shuffle:
            assert len(trainer.train_steps()) == 4 and torch.equal(data[0], tensors[0])
            continue
        with pytest.raises(DatasetWrittenError, match=r"rows 0\.\.3 were a micro-batch in training"):
            trainer.train_steps()
        assert trainer.state.records == []  # no step ran on it
        assert torch.equal(data[0][4:], tensors[0][4:]) and not torch.equal(data[0][:4], tensors[0][:4])


@pytest.mark.parametrize("shuffle", [True, False])
def test_an_in_memory_tensor_dataset_trains_bit_for_bit_as_through_the_dataloader(tmp_path: Path,
                                                                                 shuffle: bool) -> None:
    check_tensor_rows_train_as_the_dataloader(tmp_path, "cpu", shuffle=shuffle)


@pytest.mark.parametrize("kind", ["DeviceTotals", "HostTotals"])
def test_window_totals_count_exactly_and_weigh_stand_ins_zero(kind: str) -> None:
    """The window's running sums (float64: tensors on the device, Python floats on the CPU): a real micro-batch
    adds its loss and item count exactly (a float32 loss is widened, never rounded); a stand-in sample (weight 0)
    adds nothing to either, but a non-finite stand-in loss still shows (NaN: the window's check must see it)."""
    from distaccum import window as totals
    from distaccum.config import Split

    window = getattr(totals, kind)(Split(4, 3, 1), rank=0, device=torch.device("cpu"))
    tenth = torch.tensor(0.1, dtype=torch.float32)
    assert float(window.add(tenth, 4, 1.0)) == 4.0
    assert float(window.add(torch.tensor(7, dtype=torch.float32), torch.tensor(3), 1.0)) == 3.0
    assert float(window.add(torch.tensor(5.0), 2, 0.0)) == 0.0
    loss_sum, items = window.sums().tolist()
    assert window.sums().dtype == torch.float64 and loss_sum == float(tenth) + 7.0
    assert items == 7.0 and [float(n) for n in window.counts] == [4.0, 3.0, 0.0]
    window.add(torch.tensor(float("inf")), 1, 0.0)
    assert math.isnan(window.sums().tolist()[0])
    reused = torch.tensor(5.0, dtype=torch.float64)  # a loss that hands back the same count buffer each time
    window.add(torch.tensor(1.0), reused, 1.0)
    reused.fill_(9.0)
    assert float(window.counts[-1]) == 5.0


@pytest.mark.parametrize("counts_as", ["mixed", "ints", "tensors"])
@pytest.mark.parametrize("loss_norm", ["global_count", "mean_per_micro"])
def test_the_cpu_s_python_float_totals_are_bitwise_the_device_totals(loss_norm: str, counts_as: str) -> None:
    """On the CPU the window's sums are Python floats (one tensor made for the all-reduce instead of a dozen
    operations on one-number tensors); they must be the device kind's float64 arithmetic exactly: the same
    all-reduced totals, the same 1/(c N) (or NaN), the same host read and carried rows, and the same factor
    each micro-batch's loss is multiplied by. Random float32 and float64 losses, counts as ints, tensors or both
    (the device kind keeps Python counts on the host until a tensor count comes), stand-ins, a non-finite window;
    a 3-rank layout on a one-rank group as rank 2 (what was sent comes back)."""
    from conftest import one_rank_group
    from distaccum.config import Split
    from distaccum.loop import micro_factor
    from distaccum.window import DeviceTotals, HostTotals

    split = Split(micro_batch=3, accum_steps=4, world_size=3)
    gen = torch.Generator().manual_seed(7)
    with one_rank_group("cpu"):
        for case in range(6):
            windows = [kind(split, rank=2, device=torch.device("cpu")) for kind in (DeviceTotals, HostTotals)]
            losses = torch.randn(4, generator=gen, dtype=torch.float64) * 10.0 ** case
            counts = torch.randint(0, 50, (4,), generator=gen)
            for k in range(4):
                summed = losses[k].to(torch.float32) if k % 2 else losses[k]
                if case == 5 and k == 1:
                    summed = torch.tensor(float("nan"))
                as_tensor = {"mixed": k % 2 == 1, "ints": False, "tensors": True}[counts_as]
                n_items = counts[k] if as_tensor else int(counts[k])
                weight = 0.0 if case == 3 and k == 2 else 1.0
                ns = [w.add(summed, n_items, weight) for w in windows]
                factors = [micro_factor(loss_norm, 0.25 * weight, n, split) for n in ns]
                assert float(ns[0]) == ns[1] and float(factors[0]) == float(factors[1])
            assert (windows[0].device_items is None) == (counts_as == "ints")  # Python counts: no device work
            rows = [w.carry(torch.tensor([0.1 * case, -2.0, float(case)], dtype=torch.float64)) for w in windows]
            for w in windows:
                w.reduce(stop=case == 2, checkpoint_due=case == 4)
            scales = [w.grad_scale(2.0 ** -case, loss_norm) for w in windows]
            assert scales[0].dtype == scales[1].dtype == torch.float64
            if case == 5:
                assert math.isnan(float(scales[0])) and math.isnan(float(scales[1]))
            else:
                assert float(scales[0]) == float(scales[1])
            device_totals, host_totals = windows[0].totals.tolist(), windows[1].totals.tolist()
            assert len(device_totals) == len(host_totals)
            assert all(a == b or (math.isnan(a) and math.isnan(b))
                       for a, b in zip(device_totals, host_totals, strict=True))
            reads = [w.read() for w in windows]
            if case != 5:
                assert reads[0] == reads[1]
            assert rows[0]() == rows[1]() and rows[1]()[2] == [0.1 * case, -2.0, float(case)]


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


@pytest.mark.parametrize("limit_mb", [0.0, 25.0, None])
def test_a_window_of_one_micro_batch_carries_its_normalization_in_the_loss(tmp_path: Path,
                                                                           limit_mb: float | None) -> None:
    """K = 1 on the CPU with a gradient of at least ``engine.normalize_in_loss_mb`` MiB: the loss is multiplied by
    1/N (fp32) before the backward and the reduction is a plain sum, with no pass over the gradient before or
    after it. The optimizer steps with bitwise the gradient of loss_sum * fl32(1/N), not the folded one (the
    reduced sum times 1/(c N)), which differs in rounding here (N = 24), and that folded one below the limit (this
    model's gradient is 2.8 KiB) or with none; K = 3 over the same samples (always folded) agrees to fp32
    rounding."""
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(3, 32, generator=gen), torch.randn(3, 8, generator=gen))
    seen, start = {}, {}
    for micro, k in ((3, 1), (1, 3)):
        optimizers: list[RecordingSGD] = []

        def make(params: Any, kept: list[RecordingSGD] = optimizers) -> RecordingSGD:
            kept.append(RecordingSGD(params, lr=0.1))
            return kept[-1]

        cfg = config(tmp_path / f"k{k}", optim=SGD, accum={"micro_batch": micro, "steps": k, "global_batch": None},
                     data={"shuffle": False}, trainer={"max_steps": 1}, log={"grad_norm": False},
                     engine={"normalize_in_loss_mb": limit_mb})
        trainer = Trainer(cfg, model=lambda: MLP(32, 16, 2, 8), dataset=data, loss=squared_error, optimizer=make)
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
        return [p.grad if after is None else p.grad * torch.tensor(after, dtype=torch.float64).float()
                for p in model.parameters()]

    in_loss = by_hand(torch.tensor(1 / 24, dtype=torch.float64).float(), None)
    c = 2.0 ** -round(math.log2(3))  # power_of_two_scale before the first window (global batch 3)
    folded = by_hand(c, 1 / (c * 24))
    assert not all(torch.equal(a, b) for a, b in zip(in_loss, folded, strict=True))  # the test tells them apart
    assert all(torch.equal(a, b) for a, b in zip(seen[1], in_loss if limit_mb == 0.0 else folded, strict=True))
    for a, b in zip(seen[1], seen[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_a_non_finite_loss_at_k1_skips_the_step_and_the_next_one_trains(tmp_path: Path) -> None:
    """K = 1 multiplies the loss by the window's 1/(c N), which is NaN when a rank's loss was: every gradient is
    NaN, the step is skipped, and the next window (gradients zeroed in place) trains normally."""
    from distaccum import testing
    from distaccum.testing.faults import NanLoss

    testing.install(NanLoss(step=2))
    trainer = mlp_trainer(tmp_path, optim=SGD, accum={"micro_batch": 8, "steps": 1, "global_batch": None},
                          engine={"normalize_in_loss_mb": 0.0})
    trainer.setup()
    before = params(trainer)
    records = trainer.train_steps(4)
    trainer.finish()
    assert [r["skipped"] for r in records] == [False, True, False, False]
    assert math.isnan(records[1]["loss"]) and all(math.isfinite(r["loss"]) for r in records[2:])
    after = params(trainer)
    assert torch.isfinite(after).all() and not torch.equal(after, before)


def test_the_device_window_makes_few_operations() -> None:
    """On an accelerator each operation is a launch the host pays for (tens of microseconds on the hosts of
    BENCHMARKS.md's H200 runs), so the window's totals make few: none for a window of one micro-batch's loss, one
    addition per later micro-batch, one concatenation for the row (the host's numbers come in one copy), one
    all-gather (none on a one-rank group: the row is every row, as the CPU's exchange sends nothing there; the
    all-gather on real ranks: tests/fixtures/window_gather.py), and five operations for the scale (clamp, multiply,
    reciprocal, the non-finite test and its addition). Counted on the CPU with the device kind, through the
    dispatcher (views and allocations aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from conftest import one_rank_group
    from distaccum.config import Split
    from distaccum.window import DeviceTotals

    free = {"view", "select", "slice", "empty", "as_strided", "detach", "alias", "lift_fresh", "reshape", "unsqueeze",
            "expand"}

    class Counted(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.overloadpacket.__name__
            if name not in free:
                self.ops.append(name)
            return func(*args, **(kwargs or {}))

    losses = [torch.tensor(float(i) + 0.5, dtype=torch.float32) for i in range(4)]
    with one_rank_group("cpu"):
        for k in (1, 4):
            window = DeviceTotals(Split(2, k, 1), rank=0, device=torch.device("cpu"))
            per_micro = []
            for i in range(k):
                with Counted() as mode:
                    window.add(losses[i], 2, 1.0)
                per_micro.append(mode.ops)
            with Counted() as reduce:
                window.reduce(stop=False, checkpoint_due=False)
            with Counted() as scale:
                got = window.grad_scale(0.5, "global_count")
            assert per_micro[0] == [] and all(len(ops) <= 2 for ops in per_micro[1:]), per_micro  # a widening, an add
            assert reduce.ops == ["cat"], reduce.ops  # the host's numbers: no operation here; one rank: no collective
            assert len(scale.ops) == 5, scale.ops
            assert float(got) == 1.0 / (0.5 * 2 * k)
