"""Engine pieces that need no second process: the DeepSpeed config generation and merge, the
collective tap (on a one-rank gloo group), and which modules FSDP shards."""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from conftest import engine_spec
from distaccum.config import EngineConfig, Split
from distaccum.engines import check_engine, engine_class
from distaccum.engines.base import EngineSpec, GradNorms, GradSample, step_plain
from distaccum.engines.comm_tap import tap_gradient_reductions, tap_parameter_gathers
from distaccum.engines.ddp import CommHook, DDPEngine, HookState, allreduce_hook, compressed_allreduce_hook
from distaccum.engines.deepspeed_config import build, generate, merge
from distaccum.engines.fsdp import shard_units
from distaccum.models import MLP, TinyGPT
from distaccum.runtime.procgroup import collective_device
from distaccum.telemetry.gns import GradSquares
from distaccum.telemetry.ledger import CommLedger

pytestmark = pytest.mark.unit


SPLIT = Split(4, 4, 2)


def ds_cfg(
    split: Split = SPLIT,
    precision: str = "fp32",
    clip_norm: float | None = 1.0,
    sync: str = "boundary",
    **engine: object,
) -> EngineSpec:
    return engine_spec(
        EngineConfig(name="deepspeed", **engine), split, precision=precision, sync=sync, clip_norm=clip_norm
    )


@pytest.mark.parametrize("split", [Split(4, 4, 2), Split(1, 8, 4), Split(16, 1, 1), Split(3, 5, 2)])
def test_generated_batch_sizes_are_consistent_by_construction(split: Split) -> None:
    ours, _ = generate(ds_cfg(split))
    assert ours["train_batch_size"] == (
        ours["train_micro_batch_size_per_gpu"] * ours["gradient_accumulation_steps"] * split.world_size
    )
    assert (ours["train_micro_batch_size_per_gpu"], ours["gradient_accumulation_steps"]) == (
        split.micro_batch,
        split.accum_steps,
    )


def test_generated_config_follows_ours() -> None:
    ours, _ = generate(ds_cfg(zero_stage=3, precision="bf16", clip_norm=None))
    assert ours["zero_optimization"] == {"stage": 3}
    assert ours["bf16"] == {"enabled": True} and ours["fp16"] == {"enabled": False}
    assert ours["gradient_clipping"] == 0.0  # DeepSpeed's "off"
    assert generate(ds_cfg())[0]["gradient_clipping"] == 1.0
    assert ours["zero_allow_untested_optimizer"] is True  # our own torch optimizer, any ZeRO stage


def test_user_keys_we_do_not_set_are_merged() -> None:
    ours, sources = generate(ds_cfg())
    user = {
        "zero_optimization": {"overlap_comm": False, "stage": 1},
        "wall_clock_breakdown": True,
        "gradient_accumulation_steps": 4.0,
    }  # equal values (4 == 4.0 in JSON) are no conflict
    merged = merge(ours, user, sources)
    assert merged["zero_optimization"] == {"stage": 1, "overlap_comm": False}
    assert merged["wall_clock_breakdown"] is True and merged["gradient_accumulation_steps"] == 4


def test_every_conflict_is_named_with_both_values() -> None:
    ours, sources = generate(ds_cfg())
    user = {"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 2}, "fp16": {"enabled": True}}
    with pytest.raises(ValueError) as err:
        merge(ours, user, sources, origin="ds.json")
    message = str(err.value)
    assert "gradient_accumulation_steps=8 in the file, but 4 from accum.steps=4" in message
    assert "zero_optimization.stage=2 in the file, but 1 from engine.zero_stage=1" in message
    assert "fp16.enabled=true in the file, but false from precision=fp32" in message


@pytest.mark.parametrize("section", ["optimizer", "scheduler"])
def test_optimizer_and_scheduler_sections_are_refused(section: str) -> None:
    ours, sources = generate(ds_cfg())
    with pytest.raises(ValueError, match=f"'{section}' section"):
        merge(ours, {section: {"type": "Adam"}}, sources)


def test_config_validation_reads_the_user_file(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}}))
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert build(ds_cfg(deepspeed_config=str(good)))["zero_optimization"]["reduce_bucket_size"] == 1000
    with pytest.raises(
        ValueError, match=r"train_micro_batch_size_per_gpu=2 in the file, but 4 from accum.micro_batch=4"
    ):
        check_engine(ds_cfg(deepspeed_config=str(bad)))  # pre-flight: before any worker exists
    with pytest.raises(ValueError, match="no such file"):
        check_engine(ds_cfg(deepspeed_config=str(tmp_path / "missing.json")))


@pytest.mark.parametrize(
    "engine, precision, stage, sync, fragment",
    [
        ("deepspeed", "fp64", 0, "boundary", "zero_stage=0 is unsupported"),
        ("deepspeed", "fp32", 1, "every_micro", "accum.sync=every_micro with engine=deepspeed"),
        ("deepspeed", "fp16", 2, "boundary", "use precision=bf16"),
        ("fsdp", "fp16", 1, "boundary", "precision=fp16 with engine=fsdp"),
        ("accelerate", "fp16", 1, "boundary", "needs a GPU"),
    ],
)
def test_engines_refuse_what_they_cannot_run(
    engine: str, precision: str, stage: int, sync: str, fragment: str
) -> None:
    spec = engine_spec(
        EngineConfig(name=engine, zero_stage=stage), Split(2, 2, 2), precision=precision, sync=sync
    )
    with pytest.raises(ValueError, match=fragment):
        check_engine(spec)


def test_registry_knows_every_engine_and_nothing_else() -> None:
    assert {engine_class(n).name for n in ("ddp", "fsdp", "deepspeed", "accelerate")} == {
        "ddp",
        "fsdp",
        "deepspeed",
        "accelerate",
    }
    with pytest.raises(ValueError, match="horovod"):
        engine_class("horovod")


@pytest.mark.parametrize("max_norm", [None, 10.0, 1.0])
def test_the_step_normalizes_and_clips_in_one_multiply_and_reports_the_normalized_norm(
    max_norm: float | None,
) -> None:
    # The reduced gradient G = (4, ..., 4) over 7 elements, |G| = 4 sqrt(7); grad_scale 0.5: the normalized
    # gradient is (2, ...), its norm 2 sqrt(7) = 5.29; clipping to 1 scales it to norm 1 in the same multiply.
    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float64)), torch.nn.Parameter(torch.zeros(4))]
    for p in params:
        p.grad = torch.full(p.shape, 4.0, dtype=p.dtype)
    optimizer = torch.optim.SGD(params, lr=1.0)
    sample = GradSample()
    result = step_plain(
        optimizer, [("a", params[0]), ("b", params[1])], max_norm, 0.5, None, norms=GradNorms(), sample=sample
    )
    norm = 2.0 * 7**0.5
    assert result.applied and result.grad_norm == pytest.approx(norm, rel=1e-12)
    coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm is not None else 1.0
    update = torch.cat([p.detach().flatten().double() for p in params])
    assert torch.allclose(update, torch.full((7,), -2.0 * coef, dtype=torch.float64), rtol=1e-6)
    # The fingerprint's sample is of the reduced gradient before the multiply: every element 4, each tensor shorter
    # than a run (16) sampled as its first element repeated: 32 elements, weights 1..2.
    assert result.grad_sample is not None and result.grad_sample.tolist() == pytest.approx(
        [4.0 * 1.5 * 32, 16.0 * 32]
    )


@pytest.mark.parametrize("scale", [1.0, float("nan"), float("inf")])
def test_a_step_without_a_norm_skips_when_the_window_scale_is_not_finite(scale: float) -> None:
    # No clipping and no logged norm: the step's only question is whether the window's scale is finite (a
    # non-finite loss on some rank makes it NaN).
    param = torch.nn.Parameter(torch.zeros(3))
    param.grad = torch.full((3,), 2.0)
    optimizer = torch.optim.SGD([param], lr=1.0)
    result = step_plain(optimizer, [("w", param)], None, scale, None)
    assert result.applied is (scale == 1.0) and result.grad_norm is None and result.grad_sample is None
    assert param.detach().tolist() == ([-2.0] * 3 if scale == 1.0 else [0.0] * 3)


def test_host_flags_go_through_the_group_s_own_device(cpu_group: None) -> None:
    """Cross-rank flags and counts (the checkpoint verdict, the tripwire, the fingerprint) are made on
    ``collective_device()``: the CPU on gloo; on NCCL, which refuses CPU tensors, the current GPU (a CPU
    tensor there failed every CUDA run's final checkpoint: tests/test_gpu.py)."""
    assert dist.get_backend() == "gloo" and collective_device() == torch.device("cpu")
    flag = torch.ones(1, device=collective_device())
    dist.all_reduce(flag)
    assert flag.item() == dist.get_world_size()


@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
def test_tap_counts_reductions_once_and_ignores_gathers(cpu_group: None) -> None:
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
    assert (stats.gather_calls, stats.gather_bytes) == (0, 0)  # gathers are counted only when asked


@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
@pytest.mark.filterwarnings("ignore:`torch.distributed._all_gather_base` is a private function:FutureWarning")
def test_gather_tap_counts_parameter_gathers_apart_from_reductions(cpu_group: None) -> None:
    ledger = CommLedger()
    ledger.start_step()
    ledger.start_micro()
    with tap_parameter_gathers(ledger):  # what FSDP2 enters around its forward
        dist.all_gather_single(torch.empty(4), torch.ones(4))
        dist.all_gather_into_tensor(torch.empty(5), torch.ones(5))
        dist.all_gather([torch.empty(2)], torch.ones(2))
        dist.all_reduce(torch.ones(7))  # not a gather, and not tapped here
    with tap_gradient_reductions(ledger, gathers=True):  # what FSDP2 enters around its backward
        dist._all_gather_base(torch.empty(3), torch.ones(3))  # deprecated alias: counted once
        dist.all_reduce(torch.ones(6))
    dist.all_gather_into_tensor(torch.empty(100), torch.ones(100))  # outside: not counted
    stats = ledger.end_step()
    assert (stats.gather_calls, stats.gather_bytes) == (4, 4 * (4 + 5 + 2 + 3))
    assert (stats.comm_calls, stats.comm_bytes) == (1, 4 * 6)
    with pytest.raises(RuntimeError, match="not re-entrant"), tap_parameter_gathers(ledger):
        with tap_gradient_reductions(ledger):
            pass


def test_tap_restores_collectives_after_an_error(cpu_group: None) -> None:
    original = dist.distributed_c10d.reduce_scatter_single
    with pytest.raises(RuntimeError, match="boom"), tap_gradient_reductions(CommLedger()):
        raise RuntimeError("boom")
    assert dist.distributed_c10d.reduce_scatter_single is original


def test_fsdp_shards_blocks_hf_layers_or_linear_layers() -> None:
    gpt = TinyGPT(depth=3)
    assert shard_units(gpt) == list(gpt.blocks)
    assert [type(m).__name__ for m in shard_units(MLP(depth=4))] == ["Linear"] * 5

    class Decoder(torch.nn.Module):  # what a Hugging Face model declares
        _no_split_modules = ["Block"]

        def __init__(self) -> None:
            super().__init__()
            self.inner = TinyGPT(depth=2)

    decoder = Decoder()
    assert shard_units(decoder) == list(decoder.inner.blocks)


def _ddp_window_grad_pointers(grads_to_none: bool | None) -> tuple[list[int], list[int]]:
    """Three K=3 windows through the DDP engine on one rank; the gradients' addresses after the second
    window's boundary backward (bucket views once DDP has rebuilt its buckets) and after the third
    window's first, ``no_sync``, backward. ``grads_to_none=None`` steps through the engine itself."""
    torch.manual_seed(0)
    spec = engine_spec(EngineConfig(name="ddp"), Split(2, 3, 1))
    engine = DDPEngine(spec, CommLedger())
    module = engine.wrap(MLP(in_dim=8, width=16, depth=2, out_dim=4), lambda p: torch.optim.SGD(p, lr=0.1))
    params = list(engine.unwrapped().parameters())
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    after_boundary: list[int] = []
    in_window: list[int] = []
    for window in range(3):
        for k in range(3):
            with engine.sync(k == 2):
                engine.backward(((module(x) - y) ** 2).sum())
            if window == 1 and k == 2:
                after_boundary = [p.grad.data_ptr() for p in params]
            if window == 2 and k == 0:
                in_window = [p.grad.data_ptr() for p in params]
        if grads_to_none is None:
            engine.step(None, 1.0)
        else:
            step_plain(
                engine.optimizer,
                list(engine.unwrapped().named_parameters()),
                None,
                1.0,
                None,
                grads_to_none=grads_to_none,
            )
    return after_boundary, in_window


@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
def test_ddp_no_sync_backwards_accumulate_in_the_buckets_without_a_second_gradient_copy(
    cpu_group: None,
) -> None:
    after_boundary, in_window = _ddp_window_grad_pointers(None)
    assert in_window == after_boundary  # the engine's step keeps the gradients as bucket views
    # The control: dropping the gradients (zero_grad(set_to_none=True)) makes the next window's
    # no_sync backwards allocate new ones next to the buckets.
    after_boundary, in_window = _ddp_window_grad_pointers(True)
    assert not set(in_window) & set(after_boundary)


@pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning")
def test_the_ddp_step_walks_the_module_tree_once_per_run(
    cpu_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's parameter list is made at the first step and reused (a walk of the module tree per step cost
    0.45 ms on a GPT-2-shaped model); the steps after it still update every parameter."""
    spec = engine_spec(EngineConfig(name="ddp"), Split(2, 1, 1), clip_norm=1.0)
    engine = DDPEngine(spec, CommLedger())
    torch.manual_seed(0)
    module = engine.wrap(MLP(in_dim=8, width=16, depth=2, out_dim=4), lambda p: torch.optim.SGD(p, lr=0.1))
    raw = engine.unwrapped()
    before = [p.detach().clone() for p in raw.parameters()]
    walks = []
    original = type(raw).named_parameters
    monkeypatch.setattr(
        type(raw), "named_parameters", lambda self, *a, **k: (walks.append(1), original(self, *a, **k))[1]
    )
    x, y = torch.randn(2, 8), torch.randn(2, 4)
    for _ in range(4):
        engine.backward(((module(x) - y) ** 2).sum())
        result = engine.step(1.0, 1.0)
        assert result.applied and result.grad_norm is not None
    assert len(walks) == 1
    monkeypatch.undo()
    assert all(not torch.equal(a, b.detach()) for a, b in zip(before, raw.parameters(), strict=True))


class _PendingGroup:
    """Stands for a process group whose all-reduce has not finished: ``pending`` completes when the test says."""

    def __init__(self, pending: torch.futures.Future[list[torch.Tensor]]) -> None:
        self.work = SimpleNamespace(get_future=lambda: pending)

    def size(self) -> int:
        return 2

    def allreduce(self, tensors: list[torch.Tensor]) -> SimpleNamespace:
        return self.work


@pytest.mark.parametrize("hook, dtype", [(allreduce_hook, None), (compressed_allreduce_hook, torch.bfloat16)])
def test_a_pending_comm_hook_callback_holds_no_reference_to_the_process_group(
    hook: CommHook, dtype: torch.dtype | None
) -> None:
    """gloo runs a bucket's callback on its worker thread and releases it there. A callback holding the group
    could hold its last reference (a DDP engine is a reference cycle, freed by the collector; the module's group
    fixture destroys the default group), and the group's destructor then joins the thread it runs on: a test
    worker aborted with "Resource deadlock avoided". Here the all-reduce stays pending while everything else drops
    the group: it must be gone before the callback runs."""
    pending: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    group = _PendingGroup(pending)
    alive = weakref.ref(group)
    ledger, squares = CommLedger(), GradSquares()
    ledger.start_step()
    ledger.start_micro()
    buffer = torch.full((4,), 3.0)
    state = HookState(ledger, group, mean=True, squares=squares, dtype=dtype)
    bucket = (
        SimpleNamespace(  # what the hook reads of a GradBucket: one parameter, its gradient the whole buffer
            buffer=lambda: buffer,
            parameters=lambda: [torch.nn.Parameter(torch.zeros(4))],
            gradients=lambda: [buffer],
        )
    )
    reduced = hook(state, bucket)  # type: ignore[arg-type]
    del state, group
    assert alive() is None, "the bucket's pending callback holds the process group"
    pending.set_result([torch.full((4,), 5.0, dtype=dtype or torch.float32)])  # the callback runs here
    assert reduced.wait().tolist() == [5.0] * 4
    assert buffer.tolist() == ([5.0] * 4 if dtype else [1.5] * 4)  # copied back; or sent as the mean's share
    assert squares.take(torch.device("cpu"))[1].item() == 100.0  # 4 elements of 5, squared
    assert ledger.end_step().comm_calls == 1
