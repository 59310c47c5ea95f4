"""The CPU claims, re-run on CUDA (NCCL): split invariance in fp64 and one reduction per step.

Skipped without a GPU; the same assertions as tests/test_ddp_accum.py, with trainer.device=cuda.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

COMMON = ("model=tiny_gpt", "model.width=32", "data.seq_max=24", "accum.global_batch=16",
          "data.num_samples=40", "trainer.max_steps=4", "trainer.device=cuda", "precision=fp64")


def test_split_invariance_on_cuda(tmp_path: Path) -> None:
    world = min(2, torch.cuda.device_count())
    ref = train(tmp_path / "ref", *COMMON, "accum.micro_batch=16", "trainer.nproc=1")
    cand = train(tmp_path / "acc", *COMMON, f"accum.micro_batch={8 // world}", f"trainer.nproc={world}")
    assert cand.summary["accum_steps"] == 2
    for a, b in zip(ref.records, cand.records, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-9)
    assert cand.summary["param_l2"] == pytest.approx(ref.summary["param_l2"], rel=1e-9)
    if world > 1:
        assert all(r["comm_rounds"] == 1 for r in cand.records)
