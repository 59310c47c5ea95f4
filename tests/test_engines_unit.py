"""Engine pieces that need no second process: the DeepSpeed config generation and merge, the
collective tap (on a one-rank gloo group), and which modules FSDP shards."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distaccum.comm import CommLedger
from distaccum.comm_tap import tap_gradient_reductions
from distaccum.config import Split, from_mapping
from distaccum.deepspeed_config import build, generate, merge
from distaccum.engine_fsdp import shard_units
from distaccum.models import TinyGPT, build_model

pytestmark = pytest.mark.unit


def ds_cfg(**engine: object):
    return from_mapping({"engine": {"name": "deepspeed", **engine}, "accum": {"micro_batch": 4, "steps": 4}})


@pytest.mark.parametrize("split", [Split(4, 4, 2), Split(1, 8, 4), Split(16, 1, 1), Split(3, 5, 2)])
def test_generated_batch_sizes_are_consistent_by_construction(split: Split) -> None:
    ours, _ = generate(ds_cfg(), split)
    assert ours["train_batch_size"] == (ours["train_micro_batch_size_per_gpu"]
                                        * ours["gradient_accumulation_steps"] * split.world_size)
    assert (ours["train_micro_batch_size_per_gpu"], ours["gradient_accumulation_steps"]) == (
        split.micro_batch, split.accum_steps)


def test_generated_config_follows_ours() -> None:
    cfg = from_mapping({"engine": {"name": "deepspeed", "zero_stage": 3}, "precision": "bf16",
                        "optim": {"clip_norm": None}})
    ours, _ = generate(cfg, Split(4, 4, 2))
    assert ours["zero_optimization"] == {"stage": 3}
    assert ours["bf16"] == {"enabled": True} and ours["fp16"] == {"enabled": False}
    assert ours["gradient_clipping"] == 0.0  # DeepSpeed's "off"
    assert generate(ds_cfg(), Split(4, 4, 2))[0]["gradient_clipping"] == 1.0


def test_user_keys_we_do_not_set_are_merged() -> None:
    ours, sources = generate(ds_cfg(), Split(4, 4, 2))
    user = {"zero_optimization": {"overlap_comm": False, "stage": 1}, "wall_clock_breakdown": True,
            "gradient_accumulation_steps": 4.0}  # equal values (4 == 4.0 in JSON) are no conflict
    merged = merge(ours, user, sources)
    assert merged["zero_optimization"] == {"stage": 1, "overlap_comm": False}
    assert merged["wall_clock_breakdown"] is True and merged["gradient_accumulation_steps"] == 4


def test_every_conflict_is_named_with_both_values() -> None:
    ours, sources = generate(ds_cfg(), Split(4, 4, 2))
    user = {"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}
    with pytest.raises(ValueError) as err:
        merge(ours, user, sources, origin="ds.json")
    message = str(err.value)
    assert "gradient_accumulation_steps=8 in the file, but 4 from accum.steps=4" in message
    assert "zero_optimization.stage=2 in the file, but 1 from engine.zero_stage=1" in message
    assert "fp16.enabled=true in the file, but false from precision=fp32" in message


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_optimizer_and_scheduler_sections_are_refused(section: str) -> None:
    ours, sources = generate(ds_cfg(), Split(4, 4, 2))
    with pytest.raises(ValueError, match=f"'{section}' section"):
        merge(ours, {section: {"type": "Adam"}}, sources)


def test_config_validation_reads_the_user_file(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}}))
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    cfg = ds_cfg(deepspeed_config=str(good))
    assert build(cfg, cfg.split())["zero_optimization"]["reduce_bucket_size"] == 1000
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu=2 in the file, but 4 from accum.micro_batch=4"):
        ds_cfg(deepspeed_config=str(bad))  # RunConfig validation: before any worker exists
    with pytest.raises(ValueError, match="no such file"):
        ds_cfg(deepspeed_config=str(tmp_path / "missing.json"))


@pytest.fixture(scope="module")
def one_rank_group():
    if dist.is_initialized():  # another module's group: reuse it
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1)
        yield
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
def test_tap_counts_reductions_once_and_ignores_gathers(one_rank_group: None) -> None:
    ledger = CommLedger()
    ledger.start_step()
    ledger.start_micro()
    grad = torch.ones(10)
    original = dist.all_reduce
    with tap_gradient_reductions(ledger):
        dist.all_reduce(grad)  # blocking
        dist.all_reduce(torch.ones(6), async_op=True).wait()
        # deprecated alias: calls reduce_scatter_single inside, which must not count again
        dist.reduce_scatter_tensor(torch.empty(3), torch.ones(3))
        dist.all_gather_into_tensor(torch.empty(4), torch.ones(4))  # parameters: not a reduction
    dist.all_reduce(torch.ones(100))  # after the block: not counted
    stats = ledger.end_step()
    assert dist.all_reduce is original
    assert (stats.comm_calls, stats.comm_bytes, stats.comm_rounds) == (3, 4 * (10 + 6 + 3), 1)


def test_tap_restores_collectives_after_an_error(one_rank_group: None) -> None:
    original = dist.distributed_c10d.reduce_scatter_single
    with pytest.raises(RuntimeError, match="boom"), tap_gradient_reductions(CommLedger()):
        raise RuntimeError("boom")
    assert dist.distributed_c10d.reduce_scatter_single is original


def test_fsdp_shards_gpt_blocks_and_mlp_layers() -> None:
    cfg = from_mapping({"model": {"name": "tiny_gpt", "depth": 3}})
    gpt, _ = build_model(cfg.model, cfg.data)
    assert isinstance(gpt, TinyGPT) and shard_units(gpt) == list(gpt.blocks)
    mlp, _ = build_model(from_mapping({"model": {"name": "mlp", "depth": 4}}).model, cfg.data)
    assert [type(m).__name__ for m in shard_units(mlp)] == ["Linear"] * 5
