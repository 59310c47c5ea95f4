"""The CPU claims, re-run on CUDA (NCCL): split invariance in fp64 with one reduction per step,
the fp16 overflow skip on every engine that trains fp16 on a GPU (DDP, Accelerate), and
``trainer.compile=true`` under accumulation (compiles in the first window only, trains what eager
trains, passes ``verify``; the CPU tests are ``tests/test_compile.py``).

Skipped without a GPU. Checks that need two ranks skip — saying so — with fewer than two GPUs
instead of quietly running on one. The bodies are the CPU tests' (``tests/test_ddp_accum.py``,
``tests/test_loop.py``, ``tests/test_compile.py``) with ``trainer.device=cuda``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_compile import check_verify_passes_compiled
from test_loop import check_fp16_overflow_skip, check_tensor_rows_train_as_the_dataloader

from conftest import fresh_accelerate_state, one_rank_group, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

COMMON = (
    "model=tiny_gpt",
    "model.width=32",
    "data.dataset.seq_max=24",
    "accum.global_batch=16",
    "data.dataset.num_samples=40",
    "trainer.max_steps=4",
    "trainer.device=cuda",
    "precision=fp64",
)


def need_gpus(count: int) -> None:
    """Skip (visibly) when this machine has fewer than ``count`` GPUs."""
    found = torch.cuda.device_count()
    if found < count:
        pytest.skip(f"needs {count} GPUs, found {found}: the {count}-rank check did not run")


@pytest.mark.parametrize("world", [1, 2])
def test_split_invariance_on_cuda(tmp_path: Path, world: int) -> None:
    need_gpus(world)
    ref = train(tmp_path / "ref", *COMMON, "accum.micro_batch=16", "trainer.nproc=1")
    cand = train(tmp_path / "acc", *COMMON, f"accum.micro_batch={8 // world}", f"trainer.nproc={world}")
    assert cand.summary["accum_steps"] == 2 and cand.summary["world_size"] == world
    assert [r["partial_window"] for r in cand.records] == [False, False, True, False]
    for a, b in zip(ref.records, cand.records, strict=True):
        assert (b["items"], b["samples"]) == (a["items"], a["samples"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-9)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-9)  # a constant scale shows here
    for key in ("param_sum", "param_l2"):
        assert cand.summary[key] == pytest.approx(ref.summary[key], rel=1e-9)
    if world > 1:
        assert all(r["comm_rounds"] == 1 for r in cand.records)


@pytest.mark.parametrize("engine", ["ddp", "accelerate"])
def test_fp16_overflow_skip_on_cuda(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")  # as a launched rank has it (Accelerate reads it)
    fresh_accelerate_state()
    with one_rank_group("cuda"):
        check_fp16_overflow_skip(tmp_path, engine, "cuda")


@pytest.mark.parametrize(("shuffle", "pinned"), [(False, True), (True, False)])
def test_an_in_memory_tensor_dataset_on_cuda_trains_as_through_the_dataloader(
    tmp_path: Path, shuffle: bool, pinned: bool
) -> None:
    with one_rank_group("cuda"):
        check_tensor_rows_train_as_the_dataloader(tmp_path, "cuda", shuffle=shuffle, pinned=pinned)


def test_tensor_rows_for_cuda_are_views_of_a_pinned_dataset_else_pinned_copies_or_fresh_device_rows() -> None:
    """``TensorRows`` on a CUDA run: consecutive rows of a pinned host dataset are views (the move to the GPU is
    their only copy); rows of an unpinned one are copied or gathered straight into pinned memory; a dataset already
    on the GPU gives views there in order (a write into one stops the run at the next fetch:
    ``tests/test_global_batch_order.py``) and gathered rows shuffled."""
    from torch.utils.data import TensorDataset

    from distaccum.config import Split
    from distaccum.data.global_batch import GlobalBatchOrder
    from distaccum.data.pipeline import OrderSampler, micro_batches

    cuda, split = torch.device("cuda", 0), Split(2, 2, 2)
    host = torch.arange(60.0).reshape(30, 2)

    def first_rows(tensor: torch.Tensor, shuffle: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 1's first micro-batch of window 0, and the sample indices the plan gives it."""
        plan = GlobalBatchOrder(30, 8, seed=0, shuffle=shuffle)
        [rows] = next(
            micro_batches(TensorDataset(tensor), None, OrderSampler(plan, split, 1, 0, 2), device=cuda)
        )
        return rows, plan.window(0).rank_micro_batches(split, 1)[0]

    pinned = host.pin_memory()
    rows, piece = first_rows(pinned, False)
    assert rows._base is pinned and rows.is_pinned() and piece.tolist() == [2, 3]
    on_gpu = host.to(cuda)
    for shuffle in (False, True):
        rows, piece = first_rows(host, shuffle)
        assert rows.is_pinned() and rows._base is None and torch.equal(rows, host[piece])
        rows, piece = first_rows(on_gpu, shuffle)
        assert (
            rows.device == cuda
            and (rows._base is on_gpu) is not shuffle
            and torch.equal(rows.cpu(), host[piece])
        )


COMPILE_COMMON = (
    "model=tiny_gpt",
    "model.width=16",
    "model.depth=1",
    "data.dataset.num_samples=40",
    "accum.micro_batch=4",
    "accum.steps=4",
    "trainer.nproc=1",
    "trainer.max_steps=3",
    "optim.lr=1e-2",
    "trainer.device=cuda",
)
"""Variable-length sequences (8-32 tokens, padded per micro-batch), K = 4, 40 = 16 + 16 + 8 samples: the
third window is partial (micro-batches of 2)."""


def test_compiled_on_cuda_compiles_in_the_first_window_and_equals_eager(tmp_path: Path) -> None:
    eager = train(tmp_path / "eager", *COMPILE_COMMON)
    compiled = train(tmp_path / "compiled", *COMPILE_COMMON, "trainer.compile=true")
    records = compiled.records
    assert [r["partial_window"] for r in records] == [False, False, True]
    assert records[0]["compile_s"] > 0 and [r["compile_s"] for r in records[1:]] == [0.0, 0.0]
    # 0 recompiles for no_sync toggling, new lengths or the partial window
    assert [r["recompiles"] for r in records] == [0, 0, 0], records
    assert compiled.summary["recompiles"] == 0
    for a, b in zip(eager.records, records, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), a["step"]
    assert compiled.summary["param_sum"] == pytest.approx(eager.summary["param_sum"], rel=1e-4, abs=1e-4)


def test_verify_passes_a_compiled_run_on_cuda(tmp_path: Path) -> None:
    check_verify_passes_compiled(tmp_path / "v", "trainer.nproc=1", "trainer.device=cuda", "precision=fp32")
