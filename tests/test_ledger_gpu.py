"""The ledger on CUDA (events, one host sync per step, logging over a gloo side group).

Same relations as the gloo test in ``test_ledger.py``; the exact counts need two GPUs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

K, STEPS = 4, 5


def test_cuda_steps_are_timed_with_events(tmp_path: Path) -> None:
    world = min(2, torch.cuda.device_count())
    run = train(tmp_path / "run", "model=mlp", "model.width=1024", "model.depth=4", "accum.micro_batch=2",
                f"accum.steps={K}", "accum.sync=every_micro", f"trainer.max_steps={STEPS}",
                f"trainer.nproc={world}", "trainer.device=cuda")
    params = 4 * (32 * 1024 + 1024 + 3 * (1024 * 1024 + 1024) + 1024 * 8 + 8)  # fp32 bytes of the MLP
    records = run.records
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        parts = r["data_s"] + r["compute_s"] + r["comm_exposed_s"] + r["optim_s"]
        assert parts == pytest.approx(r["time_s"], abs=1e-6)
        assert r["compute_s"] > 0 and r["time_s"] > 0
        assert r["compute_min_s"] <= r["compute_s"] <= r["compute_max_s"]
        assert r["peak_mem_bytes"] >= params  # CUDA allocator peak: at least the parameters
        assert 0 <= r["comm_exposed_s"] <= r["comm_s"] + 1e-6
        if world > 1:
            assert r["comm_rounds"] == K and r["comm_bytes"] == K * params
            assert r["comm_s"] > 0
