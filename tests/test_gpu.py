"""The CPU claims, re-run on CUDA (NCCL): split invariance in fp64 with one reduction per step, and
the fp16 overflow skip on every engine that trains fp16 on a GPU (DDP, Accelerate).

Skipped without a GPU. Checks that need two ranks skip — saying so — with fewer than two GPUs
instead of quietly running on one. The bodies are the CPU tests' (``tests/test_ddp_accum.py``,
``tests/test_loop.py``) with ``trainer.device=cuda``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_loop import check_fp16_overflow_skip

from conftest import fresh_accelerate_state, one_rank_group, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

COMMON = ("model=tiny_gpt", "model.width=32", "data.dataset.seq_max=24", "accum.global_batch=16",
          "data.dataset.num_samples=40", "trainer.max_steps=4", "trainer.device=cuda", "precision=fp64")


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
