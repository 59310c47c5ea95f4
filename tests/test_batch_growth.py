"""The growing global batch (unit tier): phases, the data order's windows, the split per step, the learning
rate per phase, the adaptive rule, the config's refusals and the resume table."""

from __future__ import annotations

import math

import pytest
import torch

from distaccum.batching.adaptive import next_batch
from distaccum.batching.config import AdaptiveConfig, RampConfig
from distaccum.batching.growth import BatchGrowth, megatron_phases, phase_split
from distaccum.config import OptimConfig, RunConfig, from_mapping, to_mapping
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.data.pipeline import OrderSampler
from distaccum.optim import LrSchedule, build_scheduler, rescale
from distaccum.rundir.changes import REFUSED, classify
from distaccum.split import Split

pytestmark = pytest.mark.unit


def test_megatron_ramp_grows_by_the_increment_each_share_of_the_samples() -> None:
    """--rampup-batch-size 32 32 1000 to 128: 3 increments, one per 333.3 samples consumed."""
    phases = megatron_phases(32, 32, 1000, 128)
    assert phases == [
        (0, 32),
        (11, 64),
        (16, 96),
        (20, 128),
    ]  # 11 x 32 = 352 >= 333.3; +5 x 64 = 672 >= 666.7
    schedule = BatchGrowth(phases)
    assert [schedule.global_batch(s) for s in (0, 10, 11, 15, 16, 19, 20, 10_000)] == [
        32,
        32,
        64,
        64,
        96,
        96,
        128,
        128,
    ]
    for start, increment, samples, final in ((16, 16, 1_000_003, 1024), (8, 8, 97, 64), (32, 32, 50, 256)):
        brute, consumed, batch = [(0, start)], 0, start  # Megatron's rule, step by step
        for step in range(1, 10**6):
            consumed += batch
            now = min(start + increment * int(consumed / (samples / ((final - start) // increment))), final)
            if now != batch:
                brute.append((step, now))
                batch = now
            if batch == final:
                break
        assert megatron_phases(start, increment, samples, final) == brute
    with pytest.raises(ValueError, match="by a multiple of accum.ramp.increment"):
        megatron_phases(32, 40, 1000, 128)


def test_points_form_starts_at_step_one_and_ends_at_the_global_batch() -> None:
    ramp = RampConfig(points=[[1, 8], [4, 16], [9, 32]])
    assert BatchGrowth.of(ramp, 32).phases == [(0, 8), (3, 16), (8, 32)]
    with pytest.raises(ValueError, match="ends at accum.global_batch"):
        BatchGrowth.of(ramp, 64)
    with pytest.raises(ValueError, match="start at step 1"):
        RampConfig(points=[[2, 8], [4, 16]])
    with pytest.raises(ValueError, match="either start/increment/samples"):
        RampConfig(start=8, increment=8, samples=100, points=[[1, 8]])
    with pytest.raises(ValueError, match="start, increment and samples together"):
        RampConfig(start=8)


def test_k_follows_the_global_batch_and_the_micro_batch_drops_only_when_k_cannot_reach_it() -> None:
    assert phase_split(32, 4, 2) == Split(4, 4, 2)
    assert phase_split(8, 4, 2) == Split(4, 1, 2)
    assert phase_split(4, 4, 2) == Split(2, 1, 2)  # 2 per rank: K alone cannot get below 4
    assert phase_split(24, 8, 2) == Split(
        6, 2, 2
    )  # 12 per rank is no multiple of 8: the largest divisor below
    with pytest.raises(ValueError, match="multiple of the world size"):
        phase_split(9, 4, 2)
    lines = BatchGrowth([(0, 4), (2, 16)]).describe(4, 2, 10)
    assert lines == [
        "steps 1-2: global batch 4 = micro-batch 2 x K=1 x 2 ranks (micro-batch lowered from 4: 2 samples per rank "
        "is no multiple of it)",
        "steps 3-10: global batch 16 = micro-batch 4 x K=2 x 2 ranks",
    ]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_ramp_reads_the_unramped_sample_stream_in_order(shuffle: bool, drop_last: bool) -> None:
    """Every epoch's windows are consecutive slices of the same order an unramped run reads: no sample skipped or
    repeated at a change; an epoch ends where its samples do."""
    n = 100

    def ramped_plan() -> GlobalBatchOrder:
        return GlobalBatchOrder(
            n,
            32,
            seed=3,
            shuffle=shuffle,
            drop_last=drop_last,
            growth=BatchGrowth([(0, 8), (3, 16), (5, 32)]),
        )

    ramped = ramped_plan()
    plain = GlobalBatchOrder(n, 32, seed=3, shuffle=shuffle, drop_last=drop_last)
    windows = [ramped.window(s) for s in range(14)]
    assert [len(w.indices) for w in windows[:6]] == [8, 8, 8, 16, 16, 32]
    for epoch in (0, 1, 2):
        got = torch.cat([w.indices for w in windows if w.epoch == epoch])
        order = torch.cat([plain.window(s).indices for s in range(12) if plain.window(s).epoch == epoch])
        assert torch.equal(got, order[: len(got)])  # the same stream, cut into other windows
        if not drop_last:
            assert len(got) == n or epoch == 2  # a whole epoch, every sample once
        else:
            assert all(len(w.indices) == ramped.batch(w.step) for w in windows)  # no partial window kept
    # random access (a resume, a sampler in another process) finds the same windows as the forward walk
    again = ramped_plan()
    for step in (13, 2, 7, 0, 11):
        assert torch.equal(again.window(step).indices, windows[step].indices)


def test_each_step_is_cut_into_its_own_k_micro_batches_per_rank() -> None:
    schedule = BatchGrowth([(0, 8), (2, 16), (4, 32)])
    plan = GlobalBatchOrder(200, 32, seed=0, shuffle=True, growth=schedule)
    split = Split(4, 4, 2)  # the configured split of the final global batch
    for rank in (0, 1):
        sampler = OrderSampler(plan, split, rank, 0, 6)
        pieces = [p.tolist() for p in sampler.pieces()]
        assert [len(p) for p in pieces] == [4] * 1 + [4] * 1 + [4] * 2 + [4] * 2 + [4] * 4 + [4] * 4
        assert len(sampler) == len(pieces) == 14
    for step in range(6):
        k = plan.split_at(step, split).accum_steps
        assert k == {8: 1, 16: 2, 32: 4}[plan.batch(step)]
        window = plan.window(step)
        both = [plan.rank_pieces(step, split, r)[1] for r in (0, 1)]
        assert sorted(torch.cat([p for pieces in both for p in pieces]).tolist()) == sorted(
            window.indices.tolist()
        )
        assert plan.rank_sizes(step, split, 1) == (0, plan.batch(step), [4] * k)


def test_plan_state_carries_the_phases_an_adaptive_run_chose() -> None:
    schedule = BatchGrowth.constant(16)
    plan = GlobalBatchOrder(100, 16, seed=0, growth=schedule)
    plan.window(5)
    assert schedule.change(4, 32) and schedule.version == 1
    assert not schedule.change(6, 32)  # no change: nothing appended
    plan.next_step = 7
    state = plan.state_dict()
    fresh = GlobalBatchOrder(100, 16, seed=0, growth=BatchGrowth.constant(16))
    fresh.load_state_dict(state)
    assert fresh.growth is not None and fresh.growth.phases == [(0, 16), (4, 32)] and fresh.next_step == 7
    assert torch.equal(fresh.window(6).indices, plan.window(6).indices)
    with pytest.raises(ValueError, match="batch growth"):
        GlobalBatchOrder(100, 16, seed=0).load_state_dict(state)


def test_plan_state_saved_under_the_old_name_of_the_batch_growth_resumes() -> None:
    """Issue 57: a checkpoint's data position kept the chosen phases under ``schedule`` before; it still resumes."""
    plan = GlobalBatchOrder(100, 16, seed=0, growth=BatchGrowth([(0, 16), (4, 32)]))
    plan.next_step = 7
    state = plan.state_dict()
    state["schedule"] = state.pop("growth")
    fresh = GlobalBatchOrder(100, 16, seed=0, growth=BatchGrowth.constant(16))
    fresh.load_state_dict(state)
    assert fresh.growth is not None and fresh.growth.phases == [(0, 16), (4, 32)] and fresh.next_step == 7
    with pytest.raises(ValueError, match="batch growth"):
        GlobalBatchOrder(100, 16, seed=0).load_state_dict(state)


def test_lr_follows_lr_scaling_per_phase_and_an_adaptive_change_recomputes_the_current_lr() -> None:
    cfg = OptimConfig(lr=1e-2, schedule="constant", warmup_steps=0, lr_scaling="sqrt", base_batch=16)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg, 20, global_batch=64, batches=[[0, 16], [3, 64]])
    lrs = []
    for _ in range(5):
        lrs.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1e-2] * 3 + [2e-2] * 2, rel=1e-15)
    rescale(scheduler, 5, 256, cfg)  # the adaptive rule, after step 5: the lr of step 6 was already computed
    assert scheduler.get_last_lr()[0] == pytest.approx(4e-2, rel=1e-15)
    assert optimizer.param_groups[0]["lr"] == scheduler.get_last_lr()[0]
    saved = LrSchedule.from_state(scheduler.state_dict()["lr_lambdas"][0])
    assert saved.scales == [[0, 1.0], [3, 2.0], [5, 4.0]]
    old = LrSchedule.from_state({**saved.__dict__, "scale": 3.0})  # a checkpoint from before batch growth
    assert "scale" not in old.__dict__ and old(0) == 3.0


@pytest.mark.parametrize(
    ("noise", "per_sample", "current", "expected"),
    [
        (40.0, 1.0, 16, 32),  # x2 at most
        (20.0, 1.0, 16, 20),  # nearest whole K of 4
        (22.0, 1.0, 16, 24),
        (2.0, 1.0, 16, 8),  # at most /2
        (800.0, 10.0, 16, 32),  # items -> samples: 80 samples, capped at x2
        (-5.0, 1.0, 16, 16),  # a negative estimate keeps the batch
        (math.nan, 1.0, 16, 16),  # so does an undefined one
        (1e6, 1.0, 48, 64),  # the upper bound
        (0.1, 1.0, 8, 4),  # the lower bound (one K)
    ],
)
def test_the_adaptive_rule(noise: float, per_sample: float, current: int, expected: int) -> None:
    cfg = AdaptiveConfig(enabled=True, max_batch=64)
    lo, hi = cfg.bounds(4, 16)
    assert (lo, hi) == (4, 64)
    decision = next_batch(current, noise, per_sample, cfg, 4, lo, hi)
    assert decision.batch == expected
    assert math.isnan(decision.target) == (not (noise > 0))


def test_config_refusals() -> None:
    base = to_mapping(RunConfig())
    with pytest.raises(ValueError, match="need accum.global_batch"):
        from_mapping({**base, "accum": {**base["accum"], "ramp": {"points": [[1, 8]]}}})
    both = {
        **base["accum"],
        "global_batch": 32,
        "ramp": {"points": [[1, 8], [3, 32]]},
        "adaptive": {"enabled": True},
    }
    with pytest.raises(ValueError, match="exclude each other"):
        from_mapping({**base, "accum": both})
    with pytest.raises(ValueError, match="max_factor must be > 1"):
        AdaptiveConfig(max_factor=1.0)
    with pytest.raises(ValueError, match="above accum.adaptive.max_batch"):
        AdaptiveConfig(min_batch=64, max_batch=32)


def test_a_resume_may_not_change_the_schedule() -> None:
    saved = {"accum.ramp": to_mapping(RunConfig())["accum"]["ramp"], "accum.global_batch": 32}
    now = {**saved, "accum.ramp": {**saved["accum.ramp"], "points": [[1, 8], [3, 32]]}}
    (change,) = classify(saved, now)
    assert change.kind == REFUSED and "batch growth" in change.reason


def test_what_cannot_follow_a_schedule_is_refused_naming_it() -> None:
    from distaccum.data.sources import DataOptions, build_source
    from distaccum.datasets import SyntheticRegression
    from distaccum.resolve import batch_growth

    base = to_mapping(RunConfig())
    ramp = {**base["accum"], "micro_batch": 2, "global_batch": 16, "ramp": {"points": [[1, 4], [3, 16]]}}
    split = Split(2, 4, 2)
    for engine, name in (("deepspeed", "engine=deepspeed"), ("accelerate", "engine=accelerate")):
        cfg = from_mapping({**base, "accum": ramp, "engine": {**base["engine"], "name": engine}})
        with pytest.raises(ValueError, match=f"{name} fixes its accumulation steps"):
            batch_growth(cfg, split)
    odd = {**ramp, "ramp": {"points": [[1, 3], [3, 16]]}}
    with pytest.raises(ValueError, match="no split on 2 ranks: 3 \\(from step 1\\)"):
        batch_growth(from_mapping({**base, "accum": odd}), split)
    adaptive = {**ramp, "ramp": {"points": None}, "adaptive": {**base["accum"]["adaptive"], "enabled": True}}
    with pytest.raises(ValueError, match="set log.gns=true"):
        batch_growth(from_mapping({**base, "accum": adaptive}), split)
    schedule = batch_growth(from_mapping({**base, "accum": ramp}), split)
    assert schedule is not None and schedule.phases == [(0, 4), (2, 16)]

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from SyntheticRegression(8)

    options = DataOptions(
        seed=0, shuffle=False, drop_last=False, num_workers=0, prefetch_factor=2, growth=schedule
    )
    with pytest.raises(ValueError, match="need a map-style dataset"):
        build_source(Stream(), None, split, 0, 4, options)


def test_a_resume_on_a_world_that_cannot_split_a_chosen_batch_is_refused_naming_it() -> None:
    from torch.utils.data import TensorDataset

    from distaccum.data.pipeline import OrderSource

    chosen = BatchGrowth.constant(16)
    chosen.change(4, 20)  # what an adaptive run on 2 ranks chose
    state = GlobalBatchOrder(64, 16, seed=0, growth=chosen).state_dict()
    data = TensorDataset(torch.arange(64.0))
    for world, fails in ((2, False), (4, False), (8, True)):
        plan = GlobalBatchOrder(64, 16, seed=0, growth=BatchGrowth.constant(16))
        source = OrderSource(data, None, plan, Split(2, 16 // (2 * world), world), 0, 10)
        if fails:
            with pytest.raises(ValueError, match="no split on 8 ranks: 20 \\(from step 5\\)"):
                source.load_state_dict(state)
        else:
            source.load_state_dict(state)
            assert source.window().split == phase_split(16, 2, world)


def test_verifys_recipe_for_an_adaptive_run_is_a_valid_config_as_printed() -> None:
    """Issue 56.7: verify's refusal said to pass batch_phases as accum.ramp.points, which the config refused ("end at
    a global batch of 4, accum.global_batch is 8") until accum.global_batch was changed too; the recipe now says so.
    Its overrides, filled in with an adaptive run's batch_phases, compose into a config that verify accepts."""
    import shlex

    from distaccum.batching.adaptive import VERIFY_RECIPE
    from distaccum.cli.compose import compose_config

    adaptive = ["model=mlp", "accum.global_batch=8", "accum.micro_batch=2", "log.gns=true"]
    adaptive += ["accum.adaptive.enabled=true", "trainer.max_steps=8"]
    phases = [[1, 8], [5, 4]]  # what summary.json's batch_phases holds after the run moved to 4 from step 5
    recipe = VERIFY_RECIPE.split("the same overrides plus ")[1]
    filled = recipe.replace("BATCH_PHASES", str(phases).replace(" ", "")).replace("LAST_GLOBAL_BATCH", "4")
    cfg = compose_config([*adaptive, *shlex.split(filled)])
    assert not cfg.accum.adaptive.enabled and cfg.accum.ramp.points == phases and cfg.global_batch(2) == 4


def test_the_start_warns_when_a_ramp_or_the_adaptive_rule_does_not_play_out_within_max_steps() -> None:
    """Issue 56.3/56.10: a ramp ending after the last step, or an adaptive warm-up longer than the run, was silent."""
    from distaccum.batching.growth import describe_growth

    ramp = BatchGrowth([(0, 8), (4, 16), (8, 24), (12, 32)])
    short = describe_growth(ramp, Split(4, 2, 1), 10, OptimConfig())
    assert (
        "the ramp does not reach its end within trainer.max_steps=10: the run ends at a global batch of 24"
        in short
    )
    assert "warning" not in describe_growth(ramp, Split(4, 2, 1), 13, OptimConfig())
    adaptive = BatchGrowth([(0, 8)])
    rule = AdaptiveConfig(warmup=50)
    assert "ends before accum.adaptive.warmup=50" in describe_growth(
        adaptive, Split(4, 2, 1), 40, OptimConfig(), rule
    )
    assert "warning" not in describe_growth(adaptive, Split(4, 2, 1), 60, OptimConfig(), rule)
