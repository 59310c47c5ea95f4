"""The global-batch plan: the same samples per optimizer step whatever the split."""

from __future__ import annotations

import pytest
import torch

from distaccum.config import DataConfig, ModelConfig, Split
from distaccum.data import IGNORE_INDEX, GlobalBatchPlan, build_dataset

pytestmark = pytest.mark.unit

SPLITS = [Split(8, 1, 2), Split(2, 4, 2), Split(4, 4, 1), Split(1, 4, 4), Split(16, 1, 1)]


def _window_sets(plan: GlobalBatchPlan, split: Split, step: int) -> list[list[int]]:
    window = plan.window(step)
    return [[int(i) for i in mb] for r in range(split.world_size) for mb in window.rank_micro_batches(split, r)]


@pytest.mark.parametrize("split", SPLITS)
def test_every_split_covers_exactly_the_window(split: Split) -> None:
    plan = GlobalBatchPlan(100, 16, seed=3)
    for step in range(8):  # crosses the epoch boundary and the partial window (100 = 6*16 + 4)
        pieces = _window_sets(plan, split, step)
        flat = sorted(i for piece in pieces for i in piece)
        assert flat == sorted(int(i) for i in plan.window(step).indices)
        assert len(pieces) == split.world_size * split.accum_steps


def test_windows_do_not_depend_on_split_and_epochs_reshuffle() -> None:
    plan = GlobalBatchPlan(100, 16, seed=3)
    assert plan.windows_per_epoch == 7
    epoch0 = torch.cat([plan.window(s).indices for s in range(7)])
    epoch1 = torch.cat([plan.window(s).indices for s in range(7, 14)])
    assert sorted(epoch0.tolist()) == list(range(100)) == sorted(epoch1.tolist())
    assert not torch.equal(epoch0, epoch1)
    assert plan.window(6).partial and len(plan.window(6).indices) == 4 and not plan.window(5).partial


def test_partial_window_spreads_samples_evenly() -> None:
    plan = GlobalBatchPlan(20, 16, seed=0)
    sizes = [len(p) for p in plan.window(1).rank_micro_batches(Split(2, 4, 2), rank=0)]
    sizes += [len(p) for p in plan.window(1).rank_micro_batches(Split(2, 4, 2), rank=1)]
    assert sum(sizes) == 4 and max(sizes) - min(sizes) <= 1


def test_drop_last_skips_the_partial_window() -> None:
    plan = GlobalBatchPlan(20, 16, seed=0, drop_last=True)
    assert plan.windows_per_epoch == 1
    assert not plan.window(1).partial and plan.window(1).epoch == 1


def test_resume_continues_at_the_exact_next_window() -> None:
    plan = GlobalBatchPlan(100, 16, seed=3)
    for _ in range(5):
        next(plan)
    resumed = GlobalBatchPlan(100, 16, seed=3)
    resumed.load_state_dict(plan.state_dict())
    assert torch.equal(next(resumed).indices, next(plan).indices)
    with pytest.raises(ValueError, match="global_batch=16 in the checkpoint, 32 now"):
        GlobalBatchPlan(100, 32, seed=3).load_state_dict(plan.state_dict())


def test_token_dataset_counts_only_real_tokens() -> None:
    data = DataConfig(num_samples=64, seq_min=4, seq_max=12)
    ds = build_dataset(ModelConfig(name="tiny_gpt"), data)
    batch = ds.collate(torch.arange(8))
    lengths = (ds.targets[:8] != IGNORE_INDEX).sum(dim=1)
    assert batch.items == int(lengths.sum()) and batch.samples == 8
    assert len(set(lengths.tolist())) > 1  # variable lengths: micro-batches hold different item counts
    assert ds.inputs.shape == (64, 12)


def test_datasets_are_deterministic() -> None:
    for name in ("mlp", "tiny_gpt", "convnet_bn"):
        a = build_dataset(ModelConfig(name=name), DataConfig(num_samples=16))
        b = build_dataset(ModelConfig(name=name), DataConfig(num_samples=16))
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
