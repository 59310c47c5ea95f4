"""The per-step reduction fingerprint (distaccum/guards/fingerprint.py).

- unit: what the engine's sample sees, a mismatch names the step, ranks and parameter, NaN-aware grouping, the ranks'
  bit-for-bit agreement (:mod:`distaccum.guards.agreement`), the seed hash,
  which engines replicate their reduced gradient, world 1 does nothing, the row rides on the next window's
  collective and only a row no window carried is gathered;
- dist: a real 2-rank ``distaccum train`` whose reduction goes wrong from step 3 on (``no_sync`` on the
  wrong micro-batch, injected through the testing seam) stops at step 4, before its record, with exit 1,
  naming step 3, the ranks and the first parameter (the comparison is read a step later, so it never
  waits); with a checkpoint due at step 3 it stops at step 3 and writes no checkpoint; with
  ``trainer.fingerprint=false`` the same run goes on with desynchronized ranks until the periodic tripwire
  (``trainer.check_every=10``) stops it at step 11.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import inject, run_cli
from distaccum.engines.accelerate import AccelerateEngine
from distaccum.engines.base import GradSample, StepResult, sample_views
from distaccum.engines.ddp import DDPEngine
from distaccum.engines.deepspeed import DeepSpeedEngine
from distaccum.engines.fsdp import FSDPEngine
from distaccum.guards import agreement
from distaccum.guards.agreement import all_same, differing, groups, require, same
from distaccum.guards.fingerprint import Fingerprint, rng_hash
from distaccum.guards.tripwire import RankDivergenceError
from distaccum.rundir.checkpoint import step_dir
from distaccum.window import Carry, WindowResult


@pytest.mark.unit
def test_ranks_are_grouped_with_nan_equal_to_nan() -> None:
    nan = float("nan")
    assert same(nan, nan) and same(1.0, 1.0) and not same(1.0, nan) and not same(0.0, 1e-300)
    assert groups([[1.0, 2.0], [1.0, 2.0], [1.0, 3.0]]) == [[0, 1], [2]]
    assert groups([[nan, 1.0], [nan, 1.0]]) == [[0, 1]]  # a non-finite step is alike everywhere
    assert groups([[1.0], [2.0], [2.0], [3.0]]) == [[1, 2], [0], [3]]  # the majority first
    for rows in (
        [[1.0, 2.0], [1.0, 2.0], [1.0, 3.0]],
        [[nan, 1.0], [nan, 1.0]],
        [[1.0], [2.0], [2.0]],
        [[0.0], [-0.0]],
        [[1.0, 2.0]],
        [[nan], [1.0]],
        [[1.0, nan], [1.0, 2.0]],
    ):
        assert all_same(rows) == (len(groups(rows)) == 1), rows  # the verdict without the grouping


@pytest.mark.unit
def test_agreement_is_bit_for_bit_and_names_the_ranks_that_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the adaptive batch and the outer sync require: every rank's row the same bits as the first rank's; the
    caller's error gets every rank's numbers and the ranks that differ."""
    nan = float("nan")
    rows = torch.tensor(
        [[1.0, nan, 0.0], [1.0, nan, 0.0], [1.0, nan, -0.0], [2.0, nan, 0.0]], dtype=torch.float64
    )
    assert differing(rows) == [2, 3]  # the same NaN agrees; -0.0 is other bits than 0.0
    from conftest import one_rank_group

    with one_rank_group("cpu"):  # one rank: it agrees with itself, its row comes back
        agreed = require([1.5, 2.5], lambda rows, odd: AssertionError(odd), device=torch.device("cpu"))
    assert agreed == [[1.5, 2.5]]
    monkeypatch.setattr(agreement, "gather", lambda values, **_: torch.tensor([values, [1.5, 3.0]]).double())
    with pytest.raises(ValueError, match=r"ranks \[1\] of \[\[1.5, 2.5\], \[1.5, 3.0\]\]"):
        require([1.5, 2.5], lambda rows, odd: ValueError(f"ranks {odd} of {rows}"))


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
    check.judge(1, window([[]]), StepResult(1.0, True))  # no process group, no read, no file
    assert check.carry() is None
    check.flush()
    assert not list(tmp_path.iterdir())


def window(carried: list[list[float]], sums: tuple[float, float] = (1.0, 4.0)) -> WindowResult:
    """A window's totals as every rank reads them: ``carried`` per rank, rank r's own sums ``sums`` plus r."""
    return WindowResult(
        items=8.0,
        samples=2,
        loss_sum=2.0,
        bad_ranks=[],
        stop_votes=0,
        checkpoint_votes=0,
        items_min=4.0,
        items_max=4.0,
        rank_sums=[(sums[0] + r, sums[1]) for r in range(len(carried))],
        carried=carried,
    )


class Replicated:
    replicated_gradients = True

    def __init__(self) -> None:
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2))

    def unwrapped(self) -> torch.nn.Module:
        return self.net


@pytest.mark.unit
def test_the_sample_sees_every_tensor_and_their_order() -> None:
    """The engine's sample of the reduced gradient (what the fingerprint carries): deterministic to the bit, it sees
    a change in a tensor too small for the stride (its first run is always taken), and two tensors' gradients
    swapped (the same values at other positions) change its weighted sum but not its sum of squares."""
    torch.manual_seed(0)
    grads = [torch.randn(1000, 100), torch.randn(3), torch.randn(1000, 100)]
    base = GradSample().take(grads)
    assert base is not None and GradSample().take([g.clone() for g in grads]).tolist() == base.tolist()
    bias = [g.clone() for g in grads]
    bias[1][0] += 1e-3
    assert GradSample().take(bias).tolist() != base.tolist()
    swapped = GradSample().take([grads[2], grads[1], grads[0]])
    assert (
        swapped is not None
        and swapped[1] == pytest.approx(float(base[1]), rel=1e-12)
        and swapped[0] != base[0]
    )
    assert sum(v.numel() for v in sample_views(grads)) < sum(g.numel() for g in grads) // 10  # a sample


@pytest.mark.unit
@pytest.mark.parametrize("set_to_none", [False, True])
def test_the_sample_keeps_views_of_gradients_that_outlive_a_step_and_never_keeps_freed_ones(
    set_to_none: bool,
) -> None:
    """Gradients zeroed in place (DDP's bucket views) are sampled through views made once; gradients set to None
    each step (Accelerate's ``zero_grad``) must not be kept alive by the sample through the next backward (a second
    copy of every gradient), and each step's sample is of that step's gradients either way."""
    import gc
    import weakref

    model = torch.nn.Linear(64, 32)
    sampler, samples, freed = GradSample(), [], []
    for step in range(4):
        model.zero_grad(set_to_none=set_to_none)
        model(torch.full((3, 64), float(step + 1))).sum().backward()
        grads = [p.grad for p in model.parameters()]
        samples.append(sampler.take(grads))
        assert torch.equal(
            samples[-1], GradSample().take(grads)
        )  # this step's gradients, not a cached step's
        last = [weakref.ref(g) for g in grads]
        del grads
        model.zero_grad(set_to_none=set_to_none)
        gc.collect()
        freed.append(all(r() is None for r in last))
    assert freed == ([True] * 4 if set_to_none else [False] * 4)
    assert (sampler._views is None) == set_to_none  # the same tensors every step: views made once, kept
    assert len({tuple(s.tolist()) for s in samples}) == 4


@pytest.mark.unit
def test_the_next_window_carries_the_row_and_a_mismatch_names_the_step_ranks_and_parameter(
    tmp_path: Path,
) -> None:
    """The comparison needs no collective of its own: step 1's row (its seed hash, then the gradient sample) is what
    the fingerprint hands the next window's collective (:meth:`Fingerprint.carry`), and it is judged from that
    window's rows; rank 1's sample differs at step 2: the run stops naming step 2, rank 1 and, from the one gather
    of per-parameter checksums the diagnosis makes, the first parameter whose update differs (``1.weight``: the
    parameters in order are 0.weight, 0.bias, 1.weight, 1.bias)."""
    gathered: list[list[float]] = []

    class Counted(Fingerprint):
        def _gather(self, local: torch.Tensor) -> list[list[float]]:
            gathered.append(local.tolist())
            odd = list(gathered[-1])
            odd[2 * 2] += 1.0  # parameter 2's sum differs on rank 1
            return [gathered[-1], odd]

    check = Counted(Replicated(), tmp_path, 0, 2, torch.device("cpu"))
    assert check.carry() is None  # nothing pending yet: nothing carried
    sample = torch.tensor([1.5, 2.5], dtype=torch.float64)
    check.judge(1, window([[], []]), StepResult(5.5, True, None, sample))
    carry = check.carry()
    assert carry is not None and carry.tensor is sample and carry.floats == [rng_hash(torch.device("cpu"))]
    row = [carry.floats[0], 1.5, 2.5]
    check.judge(2, window([row, row]), StepResult(5.5, True, None, sample))  # step 1 agreed
    check.carry()
    assert gathered == []  # compared from the window's rows: no gather
    with pytest.raises(
        RankDivergenceError, match="disagree on the reduced gradient at optimizer step 2"
    ) as err:
        check.judge(3, window([row, [row[0], 1.5, 2.75]]), StepResult(5.5, True, None, sample))
    assert (err.value.parameter, err.value.rank) == ("1.weight", 1) and len(gathered) == 1
    report = json.loads((tmp_path / "divergence.json").read_text())
    assert (report["step"], report["ranks"], report["differing_parameters"]) == (2, [1], 1)


@pytest.mark.unit
def test_a_row_no_window_carried_is_gathered_at_once(tmp_path: Path) -> None:
    """Before a checkpoint, a tripwire check and at the end the pending row is gathered now (one all-gather of its
    own); here on a one-rank group standing for two ranks, the gather hands back what was sent."""
    gathered: list[list[float]] = []

    class Counted(Fingerprint):
        def _judge(self, step: int, rows: list[list[float]]) -> None:
            gathered.extend(rows)

    from conftest import one_rank_group

    with one_rank_group("cpu"):
        check = Counted(Replicated(), tmp_path, 0, 1, torch.device("cpu"))
        check.world = 1
        check.flush()  # nothing pending: nothing gathered
        assert gathered == []
        check._pending = (4, Carry([7.0], torch.tensor([1.5, 2.5], dtype=torch.float64)))
        check.flush()
        assert gathered == [[7.0, 1.5, 2.5]] and check.carry() is None


@pytest.mark.unit
def test_the_window_carries_a_row_bit_for_bit() -> None:
    """What a check hands the window's collective comes back in every rank's slot exactly (NaN kept), after the
    window's own numbers."""
    from conftest import one_rank_group
    from distaccum.window import WindowTotals

    row = torch.tensor([0.1, -3.0, 2.0**60 + 1.0, float("nan")], dtype=torch.float64)
    with one_rank_group("cpu"):
        totals = WindowTotals(torch.device("cpu"))
        for n in (3, 5):
            totals.add(torch.tensor(2.0), n, 1)
        totals.reduce(stop=False, checkpoint=True, carry=Carry([12345.0], row))
        got = totals.read()
        assert (got.items, got.items_min, got.items_max, got.checkpoint_votes) == (8.0, 3.0, 5.0, 1)
        carried = got.carried[0]
        assert carried[:4] == [12345.0, 0.1, -3.0, 2.0**60 + 1.0] and math.isnan(carried[4])


BASE = (
    "model=mlp",
    "accum.micro_batch=2",
    "accum.steps=4",
    "trainer.nproc=2",
    "trainer.max_steps=12",
    "optim.schedule=constant",
    *inject("distaccum.losses.mse", "{_target_:distaccum.testing.zoo.NoSyncOffByOne,from_step:3}"),
)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_reduction_gone_wrong_stops_the_step_after_not_at_the_next_tripwire(tmp_path: Path) -> None:
    run = run_cli("train", tmp_path / "on", *BASE, timeout=200)  # trainer.check_every: the default, 10
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((run.run_dir / "divergence.json").read_text())
    assert (report["check"], report["step"], report["ranks"]) == ("fingerprint", 3, [1])
    assert report["parameter"] == "net.0.weight" and report["differing_parameters"] == 6
    assert (
        "ranks disagree on the reduced gradient at optimizer step 3: rank(s) 1 differ from rank(s) 0"
        in run.stderr
    )
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
