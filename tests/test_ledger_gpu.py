"""The ledger and the step on CUDA: the device's clock, the host syncs per step, the 2-rank counts.

- The step clock: one test body for CPU and CUDA — every stamp of the timer and the ledger comes
  from the device's clock (``perf_counter`` on CPU, CUDA events on a GPU), never the other one.
- Host syncs: ``torch.cuda.set_sync_debug_mode("warn")`` flags every implicit synchronization;
  a steady-state step must show exactly the number the loop's docstring (:mod:`distaccum.loop`)
  documents, and a call of several steps never drains the device (no ``torch.cuda.synchronize``: the
  records lag a step). One GPU, in-process.
- The step's peak memory: the CUDA allocator's, counted again after each reset.
- The ledger on 2 NCCL ranks (exact counts and bytes, timing relations as in ``test_ledger.py``);
  skipped, saying so, with fewer than two GPUs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import fresh_accelerate_state, one_rank_group, train
from distaccum import losses
from distaccum.datasets import CorpusSequences, pad_collate
from distaccum.models import TinyGPT
from distaccum.telemetry.ledger import CudaClock, HostClock
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory
from distaccum.trainer import Trainer

NEEDS_CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICES = [pytest.param("cpu", marks=pytest.mark.unit), pytest.param("cuda", marks=NEEDS_CUDA)]
K, STEPS = 4, 5
SYNC_WARNING = "called a synchronizing CUDA operation"
FLAGGED_SYNCS_PER_STEP = {"fp32": 2, "bf16": 2, "fp16": 5}
"""As documented in distaccum/loop.py: the host reads the window's rows once (after the last backward was queued:
N and the votes) and the gradient norm once (the step is skipped when it is not finite); fp16 adds GradScaler's
found-inf read and its two scale reads. The step's timings come from its events (not flagged). Without a norm (no
clipping, ``log.grad_norm=false``): the window's read only (the fingerprint's sample stays on the device)."""
NO_NORM = {"optim": {"clip_norm": None}, "log": {"console": "quiet", "grad_norm": False}}


def gpt_trainer(
    run_dir: Path,
    device: str,
    engine: str = "ddp",
    precision: str = "fp32",
    max_steps: int = STEPS,
    **sections: Any,
) -> Trainer:
    """tiny_gpt on variable-length sequences: token counts come back from the loss as device tensors."""
    cfg = {
        "precision": precision,
        "engine": {"name": engine},
        "accum": {"micro_batch": 2, "steps": K},
        "trainer": {
            "nproc": 1,
            "max_steps": max_steps,
            "check_every": 0,
            "save_final": False,
            "device": device,
        },
        "log": {"console": "quiet"},
        "run_dir": str(run_dir),
        **sections,
    }
    return Trainer(
        cfg,
        model=lambda: TinyGPT(width=32, depth=2),
        dataset=CorpusSequences(64, seq_max=24),
        loss=losses.token_cross_entropy,
        collate=pad_collate,
    )


@pytest.mark.parametrize("device", DEVICES)
def test_steps_are_timed_on_the_devices_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    stamps = {HostClock: 0, CudaClock: 0}
    for cls in stamps:
        original = cls.stamp

        def counted(self: Any, cls: type = cls, original: Any = original) -> Any:
            stamps[cls] += 1
            return original(self)

        monkeypatch.setattr(cls, "stamp", counted)
    with one_rank_group(device):
        trainer = gpt_trainer(tmp_path, device, max_steps=2)
        records = trainer.train_steps()
        trainer.finish()
    used, unused = (CudaClock, HostClock) if device == "cuda" else (HostClock, CudaClock)
    assert stamps[unused] == 0, stamps
    # the step's start, each micro-batch's fetch start and end, the end of compute, the step's end
    assert stamps[used] >= 2 * (3 + 2 * K), stamps
    for r in records:  # (data_s may be ~0 on CUDA: copies of a few KiB between two events)
        assert r["time_s"] > 0 and r["compute_s"] > 0 and r["data_s"] >= 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("engine", "precision", "norm"),
    [
        ("ddp", "fp32", True),
        ("ddp", "bf16", True),
        ("ddp", "fp16", True),
        ("accelerate", "fp32", True),
        ("ddp", "bf16", False),
    ],
)
def test_host_syncs_per_step_are_the_documented_number(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, precision: str, norm: bool
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # as a launched rank has it (Accelerate reads it)
    fresh_accelerate_state()
    per_step: list[int] = []
    where: list[list[str]] = []
    with one_rank_group("cuda"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = gpt_trainer(
            tmp_path, "cuda", engine, precision, max_steps=2 * STEPS, **({} if norm else NO_NORM)
        )
        trainer.setup()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(STEPS):
                before = len(caught)
                trainer.train_steps(1)
                flagged = [w for w in caught[before:] if SYNC_WARNING in str(w.message)]
                per_step.append(len(flagged))
                where.append([f"{Path(w.filename).name}:{w.lineno}" for w in flagged])
        finally:
            torch.cuda.set_sync_debug_mode("default")
        drains: list[int] = []  # a call of several steps: no synchronize; each step's record a step late
        on_step_records = len(trainer.state.records)
        synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = lambda *a, **k: drains.append(1)
        try:
            records = trainer.train_steps(STEPS)
        finally:
            torch.cuda.synchronize = synchronize
        trainer.finish()
    # Steps 1-2 include one-time work (DDP rebuilds its buckets after the first synced backward).
    steady = per_step[2:]
    expected = FLAGGED_SYNCS_PER_STEP[precision] if norm else 1
    assert steady == [expected] * len(steady), (per_step, where)
    assert drains == [] and [r["step"] for r in records] == list(
        range(on_step_records + 1, on_step_records + 1 + STEPS)
    )
    assert all(r["time_s"] > 0 for r in records)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("k", "norm"), [(1, False), (4, False), (4, True)])
def test_steady_steps_allocate_no_device_block_and_create_no_timing_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, k: int, norm: bool
) -> None:
    """Past warm-up a step reuses what earlier steps allocated: no new device memory segment (a ``cudaMalloc``:
    anything allocated on a stream from the pool, as DDP's comm-hook continuations run, would cache a block per pool
    stream) and no new CUDA event for the timings (read events are recorded again). 40 steps: more than the pool's
    32 streams. DDP in bf16 without a norm, and with one (its per-tensor norms go into a buffer kept across steps).
    One rank: no fingerprint sample."""
    from torch.utils.data import TensorDataset

    from distaccum.models import MLP

    made = [0]

    class Counted(torch.cuda.Event):
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            made[0] += bool(kwargs.get("enable_timing"))  # the step's times
            return super().__new__(cls, *args, **kwargs)

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 32, generator=gen), torch.randn(64, 8, generator=gen))
    cfg = {
        "precision": "bf16",
        "engine": {"name": "ddp"},
        "accum": {"micro_batch": 4, "steps": k},
        "trainer": {"nproc": 1, "max_steps": 50, "check_every": 0, "save_final": False, "device": "cuda"},
        "run_dir": str(tmp_path),
        **({} if norm else NO_NORM),
    }
    with one_rank_group("cuda"):
        trainer = Trainer(
            cfg, model=lambda: MLP(in_dim=32, width=64, depth=2, out_dim=8), dataset=data, loss=losses.mse
        )
        trainer.train_steps(4)  # warm-up: the allocations and events the first steps make
        torch.cuda.synchronize()
        segments = torch.cuda.memory_stats()["segment.all.allocated"]
        monkeypatch.setattr(torch.cuda, "Event", Counted)
        trainer.train_steps(40)
        torch.cuda.synchronize()
        grown = torch.cuda.memory_stats()["segment.all.allocated"] - segments
        trainer.finish()
    assert (grown, made[0]) == (0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_peak_is_the_allocators_peak_since_the_reset() -> None:
    """The step's peak (read from the allocator's nested statistics, without max_memory_allocated's flattening)
    is max_memory_allocated's number, and a reset starts the count again."""
    cuda = torch.device("cuda")
    reset_peak_memory(cuda)
    base = peak_memory_bytes(cuda)
    assert base == torch.cuda.max_memory_allocated(cuda)
    big = torch.ones(64 * 2**20 // 4, device=cuda)  # 64 MiB
    grown = peak_memory_bytes(cuda)
    assert grown == torch.cuda.max_memory_allocated(cuda) >= base + 64 * 2**20
    del big
    reset_peak_memory(cuda)
    assert peak_memory_bytes(cuda) == torch.cuda.max_memory_allocated(cuda) < grown


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_rank_ledger_on_cuda(tmp_path: Path) -> None:
    found = torch.cuda.device_count()
    if found < 2:
        pytest.skip(f"needs 2 GPUs, found {found}: the 2-rank ledger check did not run")
    run = train(
        tmp_path / "run",
        "model=mlp",
        "model.width=1024",
        "model.depth=4",
        "accum.micro_batch=2",
        f"accum.steps={K}",
        "accum.sync=every_micro",
        f"trainer.max_steps={STEPS}",
        "trainer.nproc=2",
        "trainer.device=cuda",
    )
    params = 4 * (32 * 1024 + 1024 + 3 * (1024 * 1024 + 1024) + 1024 * 8 + 8)  # fp32 bytes of the MLP
    records = run.records
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert r["comm_rounds"] == K and r["comm_bytes"] == K * params
        assert r["comm_s"] > 0 and 0 < r["comm_exposed_s"] <= r["comm_s"] + 1e-9
        forward_backward = r["time_s"] - r["data_s"] - r["optim_s"]
        assert r["compute_s"] > 0 and r["comm_exposed_s"] < forward_backward
        if "compute_min_s" in r:
            assert r["compute_min_s"] <= r["compute_s"] <= r["compute_max_s"]
        assert r["peak_mem_bytes"] >= params  # CUDA allocator peak: at least the parameters
