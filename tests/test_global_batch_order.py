"""The global-batch order and the input pipeline: the same samples per optimizer step whatever the split."""

from __future__ import annotations

import inspect
from collections import namedtuple
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import TensorDataset, default_collate

from distaccum.config import Split
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.data.pipeline import DatasetWrittenError, OrderSampler, build_loader, micro_batches, to_device
from distaccum.datasets import CorpusSequences, SyntheticImages, SyntheticRegression, pad_collate
from distaccum.losses import IGNORE_INDEX

pytestmark = pytest.mark.unit

SPLITS = [Split(8, 1, 2), Split(2, 4, 2), Split(4, 4, 1), Split(1, 4, 4), Split(16, 1, 1)]


def _window_sets(plan: GlobalBatchOrder, split: Split, step: int) -> list[list[int]]:
    window = plan.window(step)
    return [
        [int(i) for i in mb] for r in range(split.world_size) for mb in window.rank_micro_batches(split, r)
    ]


@pytest.mark.parametrize("split", SPLITS)
def test_every_split_covers_exactly_the_window(split: Split) -> None:
    plan = GlobalBatchOrder(100, 16, seed=3)
    for step in range(8):  # crosses the epoch boundary and the partial window (100 = 6*16 + 4)
        pieces = _window_sets(plan, split, step)
        flat = sorted(i for piece in pieces for i in piece)
        assert flat == sorted(int(i) for i in plan.window(step).indices)
        assert len(pieces) == split.world_size * split.accum_steps


def test_windows_do_not_depend_on_split_and_epochs_reshuffle() -> None:
    plan = GlobalBatchOrder(100, 16, seed=3)
    assert plan.windows_per_epoch == 7
    epoch0 = torch.cat([plan.window(s).indices for s in range(7)])
    epoch1 = torch.cat([plan.window(s).indices for s in range(7, 14)])
    assert sorted(epoch0.tolist()) == list(range(100)) == sorted(epoch1.tolist())
    assert not torch.equal(epoch0, epoch1)
    assert plan.window(6).partial and len(plan.window(6).indices) == 4 and not plan.window(5).partial


def test_partial_window_spreads_samples_evenly() -> None:
    plan = GlobalBatchOrder(20, 16, seed=0)
    sizes = [len(p) for p in plan.window(1).rank_micro_batches(Split(2, 4, 2), rank=0)]
    sizes += [len(p) for p in plan.window(1).rank_micro_batches(Split(2, 4, 2), rank=1)]
    assert sum(sizes) == 4 and max(sizes) - min(sizes) <= 1


def test_drop_last_skips_the_partial_window_and_refuses_an_impossible_batch() -> None:
    plan = GlobalBatchOrder(20, 16, seed=0, drop_last=True)
    assert plan.windows_per_epoch == 1
    assert not plan.window(1).partial and plan.window(1).epoch == 1
    with pytest.raises(
        ValueError, match=r"global batch \(32 samples\) is larger than the dataset \(20 samples\)"
    ):
        GlobalBatchOrder(20, 32, seed=0, drop_last=True)
    with pytest.raises(ValueError, match="empty"):
        GlobalBatchOrder(0, 4, seed=0)


def test_plan_state_resumes_at_the_exact_next_window_and_refuses_another_plan() -> None:
    plan = GlobalBatchOrder(100, 16, seed=3)
    plan.next_step = 5
    resumed = GlobalBatchOrder(100, 16, seed=3)
    resumed.load_state_dict(plan.state_dict())
    assert resumed.next_step == 5 and torch.equal(resumed.window(5).indices, plan.window(5).indices)
    with pytest.raises(ValueError, match="global_batch=16 in the checkpoint, 32 now"):
        GlobalBatchOrder(100, 32, seed=3).load_state_dict(plan.state_dict())


def test_sampler_yields_each_ranks_micro_batches_in_plan_order_with_stand_ins_for_empty_pieces() -> None:
    plan = GlobalBatchOrder(20, 16, seed=0, shuffle=False)
    split = Split(1, 4, 2)
    plan.next_step = 1  # resume at the partial window: 4 samples for 8 pieces
    batches = list(OrderSampler(plan, split, rank=1, start=1, stop=3))
    assert len(batches) == 8
    window = plan.window(1)
    pieces = window.rank_micro_batches(split, 1)
    for got, piece in zip(batches[:4], pieces, strict=True):
        assert got == (piece.tolist() if len(piece) else [int(window.indices[0])])
    assert batches[4:] == [p.tolist() for p in plan.window(2).rank_micro_batches(split, 1)]


def plans_and_splits(
    samples: int, *, shuffle: bool, seed: int = 0
) -> Iterator[tuple[GlobalBatchOrder, Split]]:
    """Every split of a few global batches (4, 8, 16) of a plan over ``samples`` samples: partial windows, empty
    pieces, several ranks."""
    for global_batch in (4, 8, 16):
        plan = GlobalBatchOrder(samples, global_batch, seed=seed, shuffle=shuffle)
        for micro, world in ((1, 1), (1, 2), (2, 2), (1, 3), (3, 1), (1, 4)):
            if global_batch % (micro * world) == 0:
                yield plan, Split(micro, global_batch // (micro * world), world)


@pytest.mark.parametrize("samples", [20, 50, 64, 3])
def test_rank_ranges_are_the_in_order_pieces_by_arithmetic(samples: int) -> None:
    """``rank_ranges`` (what the in-process fetch cuts an in-order plan by, no tensors) against the sampler's
    pieces for every split of a few global batches, over partial windows with empty pieces and epochs: the same
    rows, the stand-in (the window's first sample) for an empty piece; a shuffled plan is refused."""
    for plan, split in plans_and_splits(samples, shuffle=False):
        for rank in range(split.world_size):
            sampler = OrderSampler(plan, split, rank, start=0, stop=2 * plan.windows_per_epoch + 1)
            want = [p.tolist() for p in sampler.pieces()]
            got = [list(range(first, first + n)) for first, n in sampler.ranges()]
            assert got == want, (samples, plan.global_batch, split, rank)
    with pytest.raises(ValueError, match="in-order global-batch order"):
        GlobalBatchOrder(20, 4, seed=0).rank_ranges(0, Split(1, 2, 2), 0)


@pytest.mark.parametrize("shuffle", [False, True])
def test_rank_sizes_are_the_windows_and_pieces_sizes_by_arithmetic(shuffle: bool) -> None:
    """``rank_sizes`` (what the loop's window needs: epoch, samples, each micro-batch's size; no tensors) against
    the cut window for every split of a few global batches, over partial windows with empty pieces and epochs."""
    for samples in (20, 50, 64, 3):
        for plan, split in plans_and_splits(samples, shuffle=shuffle, seed=1):
            for step in range(2 * plan.windows_per_epoch + 1):
                for rank in range(split.world_size):
                    window, pieces = plan.rank_pieces(step, split, rank)
                    want = (window.epoch, len(window.indices), [len(p) for p in pieces])
                    assert plan.rank_sizes(step, split, rank) == want, (
                        samples,
                        plan.global_batch,
                        split,
                        step,
                        rank,
                    )


def test_a_plan_keeps_each_epochs_order_and_hands_out_the_windows_a_fresh_plan_would() -> None:
    plan = GlobalBatchOrder(50, 8, seed=3)  # 7 windows per epoch, the last partial
    steps = [0, 1, 6, 7, 13, 2, 20, 8, 0]  # within, across and back over epochs
    for step in steps:
        fresh = GlobalBatchOrder(50, 8, seed=3).window(step)
        got = plan.window(step)
        assert (got.epoch, got.indices.tolist()) == (fresh.epoch, fresh.indices.tolist())
    assert plan.window(7).indices.tolist() != plan.window(0).indices.tolist()  # epochs reshuffle


def test_rank_pieces_are_the_windows_pieces_computed_once_for_the_last_few_steps() -> None:
    plan = GlobalBatchOrder(50, 8, seed=3)
    split = Split(2, 2, 2)
    for step in [0, 1, 6, 7, 13, 2, 20, 8, 0, 1]:  # what the sampler and the loop ask, out of order too
        for rank in (0, 1):
            window, pieces = plan.rank_pieces(step, split, rank)
            fresh = GlobalBatchOrder(50, 8, seed=3).window(step)
            assert (window.step, window.epoch, window.indices.tolist()) == (
                step,
                fresh.epoch,
                fresh.indices.tolist(),
            )
            assert [p.tolist() for p in pieces] == [p.tolist() for p in fresh.rank_micro_batches(split, rank)]
    first = plan.rank_pieces(1, split, 0)
    assert plan.rank_pieces(1, split, 0) is first  # asked again (the loop after the sampler): not recomputed
    assert plan.rank_pieces(1, Split(1, 4, 2), 0)[1] != first[1]  # another split cuts other pieces
    assert len(plan._pieces) <= 4  # bounded however long the run


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tensor_dataset_is_fetched_a_micro_batch_at_a_time_as_default_collate_would_batch_it(
    workers: int,
) -> None:
    from torch.utils.data import TensorDataset

    from distaccum.data.pipeline import TensorBatches

    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(30, 5, generator=gen), torch.randint(0, 9, (30,), generator=gen))
    plan = GlobalBatchOrder(len(dataset), 8, seed=0)
    split = Split(2, 2, 2)
    loader = build_loader(
        dataset, None, OrderSampler(plan, split, rank=1, start=0, stop=5), num_workers=workers
    )
    assert isinstance(
        loader.dataset, TensorBatches
    )  # one index_select per tensor, not 2 __getitem__ + a stack
    got = list(loader)
    assert len(got) == 5 * split.accum_steps
    for step in range(5):  # the last window of the epoch is partial: pieces of 1 sample
        for k, piece in enumerate(plan.window(step).rank_micro_batches(split, 1)):
            want = default_collate(
                [dataset[int(i)] for i in (piece if len(piece) else plan.window(step).indices[:1])]
            )
            batch = got[step * 2 + k]
            assert type(batch) is type(want) and len(batch) == 2
            for a, b in zip(batch, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
    assert (
        type(build_loader(dataset, pad_collate, OrderSampler(plan, split, 0, 0, 1)).dataset) is TensorDataset
    )  # a collate: as given


def _tensor_dataset() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(30, 5, generator=gen), torch.randint(0, 9, (30,), generator=gen))


@pytest.mark.parametrize("shuffle", [True, False])
def test_tensor_rows_hand_out_the_batches_the_dataloader_makes(shuffle: bool) -> None:
    dataset = _tensor_dataset()
    split = Split(2, 2, 2)
    for rank in (0, 1):
        plan = GlobalBatchOrder(len(dataset), 8, seed=0, shuffle=shuffle)
        plan.next_step = 1  # from a resume position: the partial window (30 = 3 x 8 + 6) and the next epoch
        sampler = OrderSampler(plan, split, rank, plan.next_step, 6)
        fast = micro_batches(dataset, None, sampler, device=torch.device("cpu"))
        assert inspect.isgenerator(fast)  # TensorRows: no DataLoader iterator
        loader = build_loader(dataset, None, sampler)
        got, want = list(fast), list(loader)
        assert len(got) == len(want) == 5 * split.accum_steps
        for a, b in zip(got, want, strict=True):
            assert type(a) is type(b) is list and len(a) == 2
            for x, y in zip(a, b, strict=True):
                assert x.dtype == y.dtype and torch.equal(x, y)


def test_tensor_rows_in_order_are_views_and_a_write_into_one_stops_at_the_next_micro_batch() -> None:
    """Consecutive rows are handed out as views of the dataset (no copy, as a hand-written loop slices), on the
    training device or not; a loss that reads them leaves every micro-batch to come; one that writes into its batch
    (in place, under no_grad too, through a view of the view) is stopped at the next fetch, naming the rows,
    before a later micro-batch or epoch trains on changed data. Shuffled rows are gathered: fresh, free to write."""
    dataset = _tensor_dataset()
    split = Split(2, 2, 2)
    plan = GlobalBatchOrder(len(dataset), 8, seed=0, shuffle=False)
    for device in ("cpu", "meta"):  # meta stands in for an accelerator
        rows = next(
            micro_batches(dataset, None, OrderSampler(plan, split, 1, 0, 4), device=torch.device(device))
        )
        assert all(r._base is t for r, t in zip(rows, dataset.tensors, strict=True))
        assert torch.equal(rows[0], dataset.tensors[0][2:4])  # rank 1's first piece of window 0: samples 2, 3
    read = list(micro_batches(dataset, None, OrderSampler(plan, split, 0, 0, 4), device=torch.device("cpu")))
    assert len(read) == 8 and all(r[0]._base is dataset.tensors[0] for r in read)  # reading is free
    writes = {
        "mul_": lambda b: b[0].mul_(0.0),
        "setitem": lambda b: b[1].__setitem__(b[1] > 3, -100),
        "no_grad": lambda b: torch.no_grad()(lambda: b[0].add_(1.0))(),
        "view of the view": lambda b: b[0].view(-1)[:1].zero_(),
    }
    for name, write in writes.items():
        fresh = _tensor_dataset()
        batches = micro_batches(fresh, None, OrderSampler(plan, split, 0, 0, 4), device=torch.device("cpu"))
        next(batches)
        write(next(batches))  # the second micro-batch: rows 4, 5
        with pytest.raises(DatasetWrittenError, match="rows 4..5 were a micro-batch in training"):
            next(batches)
        assert not torch.equal(fresh.tensors[0], _tensor_dataset().tensors[0]) or name == "setitem", name
    shuffled = GlobalBatchOrder(len(dataset), 8, seed=0, shuffle=True)
    for batch in micro_batches(
        dataset, None, OrderSampler(shuffled, split, 0, 0, 4), device=torch.device("cpu")
    ):
        batch[0].mul_(0.0)  # gathered: the dataset never sees it
    assert torch.equal(dataset.tensors[0], _tensor_dataset().tensors[0])


def test_tensor_rows_of_an_inference_mode_dataset_are_copies_a_backward_can_save() -> None:
    """A dataset made under ``torch.inference_mode`` (features precomputed by a frozen encoder): a view of it could
    neither be watched (no version counter) nor saved for the backward, so its rows are copied, normal tensors;
    a normal tensor beside it is still handed out as views."""
    with torch.inference_mode():
        features = torch.randn(30, 5)
    labels = torch.randn(30, 2)
    layer = torch.nn.Linear(5, 2)
    plan, split = GlobalBatchOrder(30, 8, seed=0, shuffle=False), Split(2, 2, 2)
    for x, y in micro_batches(
        TensorDataset(features, labels), None, OrderSampler(plan, split, 0, 0, 4), device=torch.device("cpu")
    ):
        assert not x.is_inference() and x._base is None and y._base is labels
        torch.nn.functional.mse_loss(layer(x), y).backward()  # saved for backward: no error
    assert layer.weight.grad is not None


def test_a_tensor_dataset_with_a_collate_workers_or_a_subclass_goes_through_the_dataloader() -> None:
    dataset, cpu = _tensor_dataset(), torch.device("cpu")
    window = OrderSampler(GlobalBatchOrder(30, 8, seed=0), Split(2, 2, 2), rank=0, start=0, stop=1)

    class Rows(TensorDataset):
        pass

    for it in (
        micro_batches(dataset, pad_collate, window, device=cpu),
        micro_batches(dataset, None, window, device=cpu, num_workers=1),
        micro_batches(Rows(*dataset.tensors), None, window, device=cpu),
    ):
        assert not inspect.isgenerator(it)  # a DataLoader's iterator
        del it  # the worker exits


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_collates_the_plan_through_dataloader_workers(workers: int) -> None:
    dataset = CorpusSequences(num_samples=40, seq_min=3, seq_max=9, seed=1)
    plan = GlobalBatchOrder(len(dataset), 8, seed=0)
    split = Split(2, 2, 2)
    loader = build_loader(
        dataset, pad_collate, OrderSampler(plan, split, rank=0, start=0, stop=3), num_workers=workers
    )
    got = list(loader)
    assert len(got) == 3 * split.accum_steps
    for step in range(3):
        for k, piece in enumerate(plan.window(step).rank_micro_batches(split, 0)):
            want = pad_collate([dataset[int(i)] for i in piece])
            assert torch.equal(got[step * 2 + k]["input_ids"], want["input_ids"])


def test_corpus_sequences_have_variable_lengths_and_pad_collate_ignores_padding() -> None:
    ds = CorpusSequences(num_samples=64, seq_min=4, seq_max=12, seed=0)
    lengths = [len(ds[i]["input_ids"]) for i in range(64)]
    assert min(lengths) >= 4 and max(lengths) <= 12 and len(set(lengths)) > 1
    batch = pad_collate([ds[i] for i in range(8)])
    real = (batch["labels"] != IGNORE_INDEX).sum()
    assert int(real) == sum(lengths[:8]) == int(batch["attention_mask"].sum())
    assert torch.equal(ds[3]["labels"][:-1], ds[3]["input_ids"][1:])  # next-token targets
    with pytest.raises(ValueError, match="pad_to=4"):
        pad_collate([ds[i] for i in range(8)], pad_to=4)


def test_datasets_are_deterministic() -> None:
    for make in (lambda: SyntheticRegression(16), lambda: SyntheticImages(16), lambda: CorpusSequences(16)):
        a, b = make(), make()
        for i in range(len(a)):
            first, second = a[i], b[i]
            values = first.values() if isinstance(first, dict) else first
            others = second.values() if isinstance(second, dict) else second
            assert all(torch.equal(x, y) for x, y in zip(values, others, strict=True))


Pair = namedtuple("Pair", "x y")


@dataclass
class Holder:
    x: torch.Tensor
    tag: str


def test_to_device_moves_any_structure_and_casts_floats_only() -> None:
    batch = {
        "a": torch.ones(2),
        "b": [torch.zeros(1, dtype=torch.long), (torch.ones(1),)],
        "c": Pair(torch.ones(1), 3),
        "d": Holder(torch.ones(1), "t"),
        "e": "text",
    }
    out = to_device(batch, torch.device("cpu"), torch.float64)
    assert out["a"].dtype == torch.float64 and out["b"][0].dtype == torch.long
    assert out["b"][1][0].dtype == torch.float64 and isinstance(out["b"][1], tuple)
    assert isinstance(out["c"], Pair) and out["c"].x.dtype == torch.float64 and out["c"].y == 3
    assert isinstance(out["d"], Holder) and out["d"].x.dtype == torch.float64 and out["e"] == "text"
