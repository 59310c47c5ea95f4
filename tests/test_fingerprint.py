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
from distaccum.verify.fingerprint import Fingerprint, all_same, gradient_sample, groups, rng_hash, same


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
    for rows in ([[1.0, 2.0], [1.0, 2.0], [1.0, 3.0]], [[nan, 1.0], [nan, 1.0]], [[1.0], [2.0], [2.0]], [[0.0], [-0.0]],
                 [[1.0, 2.0]], [[nan], [1.0]], [[1.0, nan], [1.0, 2.0]]):
        assert all_same(rows) == (len(groups(rows)) == 1), rows  # the verdict without the grouping


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


@pytest.mark.unit
@pytest.mark.parametrize("set_to_none", [False, True])
def test_the_sample_keeps_views_of_gradients_that_outlive_a_step_and_never_keeps_freed_ones(
        tmp_path: Path, set_to_none: bool) -> None:
    """Gradients zeroed in place (DDP's bucket views) are sampled through views made once; gradients set to None
    each step (Accelerate's ``zero_grad``) must not be kept alive by the check through the next backward (a second
    copy of every gradient), and each step's sample is of that step's gradients either way."""
    import gc
    import weakref

    model = torch.nn.Linear(64, 32)

    class Engine:
        replicated_gradients = True

        def unwrapped(self) -> torch.nn.Module:
            return model

    check = Fingerprint(Engine(), tmp_path, 0, 2, torch.device("cpu"))
    samples, freed = [], []
    for step in range(4):
        model.zero_grad(set_to_none=set_to_none)
        model(torch.full((3, 64), float(step + 1))).sum().backward()
        grads = [p.grad for p in model.parameters()]
        samples.append(check._sample())
        assert torch.equal(samples[-1], gradient_sample(grads))  # this step's gradients, not a cached step's
        last = [weakref.ref(g) for g in grads]
        del grads
        model.zero_grad(set_to_none=set_to_none)
        gc.collect()
        freed.append(all(r() is None for r in last))
    if set_to_none:
        assert freed == [True] * 4
        assert check._views == ([], [])
    else:
        assert freed == [False] * 4 and check._views[0]  # the same tensors every step: views made once
    assert len({tuple(s.tolist()) for s in samples}) == 4


@pytest.mark.unit
@pytest.mark.parametrize("kind", ["DeviceTotals", "HostTotals"])
def test_the_next_window_carries_each_ranks_row_in_its_slot_and_the_check_reads_it_from_there(tmp_path: Path,
                                                                                              kind: str) -> None:
    """The comparison needs no collective of its own: a window's all-reduce carries the previous step's rows
    (this rank's in its slot, zeros in the others: the sum is an exact all-gather), the check judges them from
    the totals' one host read, and only rows no window carried yet are gathered (before a checkpoint, at the end).
    Here: a 2-rank layout on a one-rank group, as rank 1, so the all-reduce hands back exactly what was sent; both
    kinds of window totals (on the device, and the CPU's Python floats)."""
    from conftest import one_rank_group
    from distaccum import window

    WindowTotals = getattr(window, kind)  # noqa: N806 - a class
    from distaccum.split import Split

    split = Split(micro_batch=2, accum_steps=2, world_size=2)
    row = torch.tensor([0.1, -3.0, 2.0**60 + 1.0, float("nan")], dtype=torch.float64)  # exact: float64 + 0.0
    with one_rank_group("cpu"):
        window = WindowTotals(split, rank=1, device=torch.device("cpu"))
        for n in (3, 5):
            window.add(torch.tensor(2.0), n, 1.0)
        rows = window.carry(row)
        window.reduce(stop=False, checkpoint_due=False)
        assert rows() is None  # nothing read yet
        host = window.read()
        assert (host.items, host.items_min, host.items_max, host.bad_ranks) == (8.0, 0.0, 5.0, [])  # rank 0's slot: 0
        got = rows()
        assert got is not None and got[0] == [0.0] * 4
        assert got[1][:3] == row.tolist()[:3] and got[1][3] != got[1][3]  # bitwise, NaN kept

        class Replicated:
            replicated_gradients = True

            def __init__(self) -> None:
                self.net = torch.nn.Linear(3, 2)
                self.net(torch.ones(1, 3)).sum().backward()

            def unwrapped(self) -> torch.nn.Module:
                return self.net

        gathered: list[list[float]] = []

        class Counted(Fingerprint):
            def _gather(self, local: torch.Tensor | list[float]) -> list[list[float]]:
                gathered.append(local if isinstance(local, list) else local.tolist())  # the CPU's rows are floats
                return [gathered[-1]] * self.world

        check = Counted(Replicated(), tmp_path, 1, 2, torch.device("cpu"))
        first = WindowTotals(split, rank=1, device=torch.device("cpu"))
        first.add(torch.tensor(1.0), 4, 1.0)
        check.before_reduce(first)  # nothing pending yet: nothing carried
        first.reduce(stop=False, checkpoint_due=False)
        check.after_reduction(1, first)
        second = WindowTotals(split, rank=1, device=torch.device("cpu"))
        second.add(torch.tensor(1.0), 4, 1.0)
        check.before_reduce(second)  # step 1's row rides on step 2's all-reduce
        second.reduce(stop=False, checkpoint_due=False)
        check.after_reduction(2, second)
        second.read()
        with pytest.raises(Exception, match="disagree on the reduced gradient at optimizer step 1"):
            check.judge(1)  # rank 0's slot came back as zeros: it "differs", read from the carried totals
        # The comparison came with the totals; the one gather is the diagnosis's, after the mismatch: each
        # parameter's (sum, sum of squares), 2 parameters.
        assert [len(t) for t in gathered] == [4]
        check.judge(2)  # step 2: no window carried it (a checkpoint or the end): its 5 numbers gathered at once
        assert [len(t) for t in gathered] == [4, 5]


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

