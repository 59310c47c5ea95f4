"""Host work per step, counted rather than timed (``benchmarks.host_ops``): the top-level operators distaccum's
step issues outside the model's forward and backward, the loss and the optimizer, against the expert hand-written
``no_sync`` loop on the same model, data and loss, at K = 1 and K = 16 on two gloo ranks. Adding work to the hot
path fails here instead of hiding in timing noise.

Budget: at most 2 operators of distaccum's own per micro-batch and at most 10 per step beyond the expert loop's.
Today, with the defaults: 0 per micro-batch (the loss's multiply stands where the expert divides) and 8 per step (the
window's row and all-gather: 3; the recorded gradient norm: 2; the reduction fingerprint's sample: 2; the one
multiply that normalizes and clips).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.host_ops import extra, measure, table

pytestmark = pytest.mark.dist

PER_MICRO, PER_STEP = 2, 10
LAUNCHES_PER_STEP = 12
"""On CUDA: the window's stack and concatenation, its all-gather, the norms' kernels and the one multiply."""


@pytest.mark.timeout(400)
def test_distaccum_s_own_operators_per_step_stay_within_budget(tmp_path: Path) -> None:
    counts = {k: measure(k, tmp_path) for k in (1, 16)}
    print(table(counts))
    per_micro, per_step = extra(counts)
    assert per_micro <= PER_MICRO and per_step <= PER_STEP, table(counts)
    # The count is exact: the expert loop's own work is the slicing and the division, once per micro-batch.
    assert counts[16]["expert"]["names"]["aten::div"] == 16 and counts[1]["expert"]["names"]["aten::div"] == 1
    assert (
        counts[16]["distaccum"]["names"].get("c10d::_allgather_base_") == 1
    )  # one window collective per step


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(600)
def test_on_cuda_its_own_launches_and_host_syncs_stay_within_budget(tmp_path: Path) -> None:
    """The same counts on every GPU of the machine (NCCL), with the kernel launches outside the user's code, the
    backward and the optimizer, and every host synchronization of the step: the window's rows read once and the
    gradient norm once, none per micro-batch."""
    counts = {k: measure(k, tmp_path, device="cuda") for k in (1, 16)}
    print(table(counts))
    per_micro, per_step = extra(counts)
    assert per_micro <= PER_MICRO and per_step <= PER_STEP, table(counts)
    launches, syncs = extra(counts, "launches"), extra(counts, "syncs")
    assert launches[0] <= PER_MICRO and launches[1] <= LAUNCHES_PER_STEP, table(counts)
    assert syncs[0] <= 0 and syncs[1] <= 2, table(counts)
