"""The per-step reduction fingerprint (distaccum/verify/fingerprint.py).

- unit: what the sampled scalars see (the first element of every tensor, the order of the tensors),
  NaN-aware grouping of ranks, the seed hash, which engines replicate their reduced gradient, world 1
  does nothing;
- dist: a real 2-rank ``distaccum train`` whose reduction goes wrong from step 3 on (``no_sync`` on the
  wrong micro-batch, injected through the testing seam) stops at step 4, before its record, with exit 1,
  naming step 3, the ranks and the first parameter (the comparison is read a step later, so it never
  waits); with a checkpoint due at step 3 it stops at step 3 and writes no checkpoint; with
  ``trainer.fingerprint=false`` the same run goes on with desynchronized ranks until the periodic tripwire
  (``trainer.check_every=10``) stops it at step 11.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import inject, run_cli
from distaccum.engines.accelerate import AccelerateEngine
from distaccum.engines.ddp import DDPEngine
from distaccum.engines.deepspeed import DeepSpeedEngine
from distaccum.engines.fsdp import FSDPEngine
from distaccum.rundir.checkpoint import step_dir
from distaccum.verify.fingerprint import Fingerprint, gradient_sample, groups, rng_hash, same


@pytest.mark.unit
def test_the_sample_sees_every_tensor_and_their_order() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(1000, 100), torch.randn(3), torch.randn(1000, 100)]
    base = gradient_sample(grads)
    assert gradient_sample([g.clone() for g in grads]).tolist() == base.tolist()  # deterministic, bitwise
    bias = [g.clone() for g in grads]
    bias[1][0] += 1e-3  # a 3-element tensor: the stride skips it, but its first element is always sampled
    assert gradient_sample(bias).tolist() != base.tolist()
    swapped = gradient_sample([grads[2], grads[1], grads[0]])
    assert swapped[1] == pytest.approx(float(base[1]), rel=1e-12)  # the same values...
    assert swapped[0] != base[0]  # ...at other positions: the weighted sum tells
    assert sum(g.numel() for g in grads) // 4096 > 1  # the sample is a sample, not the whole gradient


@pytest.mark.unit
def test_ranks_are_grouped_with_nan_equal_to_nan() -> None:
    nan = float("nan")
    assert same(nan, nan) and same(1.0, 1.0) and not same(1.0, nan) and not same(0.0, 1e-300)
    assert groups([[1.0, 2.0], [1.0, 2.0], [1.0, 3.0]]) == [[0, 1], [2]]
    assert groups([[nan, 1.0], [nan, 1.0]]) == [[0, 1]]  # a non-finite step is alike everywhere
    assert groups([[1.0], [2.0], [2.0], [3.0]]) == [[1, 2], [0], [3]]  # the majority first


@pytest.mark.unit
def test_the_seed_hash_follows_the_last_seed_not_the_draws() -> None:
    torch.manual_seed(5)
    first = rng_hash(torch.device("cpu"))
    torch.rand(100)  # draws move the state, not the seed
    assert rng_hash(torch.device("cpu")) == first
    torch.manual_seed(6)
    assert rng_hash(torch.device("cpu")) != first
    assert float(int(first)) == first  # an exact float


@pytest.mark.unit
def test_only_engines_that_replicate_the_reduced_gradient_compare_it(tmp_path: Path) -> None:
    assert DDPEngine.replicated_gradients and AccelerateEngine.replicated_gradients
    assert not FSDPEngine.replicated_gradients and not DeepSpeedEngine.replicated_gradients

    class World1Engine:
        replicated_gradients = True

        def unwrapped(self) -> torch.nn.Module:
            raise AssertionError("world 1 has nothing to compare: the gradients are never read")

    check = Fingerprint(World1Engine(), tmp_path, 0, 1, torch.device("cpu"))
    check.after_reduction(1, object())  # no process group, no read, no file
    check.judge(1)
    assert not list(tmp_path.iterdir())


BASE = ("model=mlp", "accum.micro_batch=2", "accum.steps=4", "trainer.nproc=2", "trainer.max_steps=12",
        "optim.schedule=constant",
        *inject("distaccum.losses.mse", "{_target_:distaccum.testing.zoo.NoSyncOffByOne,from_step:3}"))


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_reduction_gone_wrong_stops_the_step_after_not_at_the_next_tripwire(tmp_path: Path) -> None:
    run = run_cli("train", tmp_path / "on", *BASE, timeout=200)  # trainer.check_every: the default, 10
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((run.run_dir / "divergence.json").read_text())
    assert (report["check"], report["step"], report["ranks"]) == ("fingerprint", 3, [1])
    assert report["parameter"] == "net.0.weight" and report["differing_parameters"] == 6
    assert "ranks disagree on the reduced gradient at optimizer step 3: rank(s) 1 differ from rank(s) 0" in run.stderr
    # Step 3's comparison is read one step later (no wait in step 3): the run stops at step 4, before its record.
    assert [r["step"] for r in run.records] == [1, 2, 3]

    # Before a checkpoint the pending comparison is read at once: no checkpoint holds the diverged step.
    saving = run_cli("train", tmp_path / "saving", *BASE, "trainer.checkpoint_every=3", timeout=200)
    assert saving.returncode == 1, saving.stdout[-2000:] + saving.stderr[-3000:]
    assert json.loads((saving.run_dir / "divergence.json").read_text())["step"] == 3
    assert [r["step"] for r in saving.records] == [1, 2, 3]
    assert not step_dir(saving.run_dir / "checkpoints", 3).exists()

    off = run_cli("train", tmp_path / "off", *BASE, "trainer.fingerprint=false", timeout=200)
    assert off.returncode == 1, off.stdout[-2000:] + off.stderr[-3000:]
    report = json.loads((off.run_dir / "divergence.json").read_text())
    assert report["step"] == 11 and "check" not in report  # the tripwire: 8 steps on desynchronized ranks
    assert [r["step"] for r in off.records] == list(range(1, 11))  # step 11 stopped before its record

