"""The batch growth's set-ups: a global batch that changes during the run (``accum.ramp``, the adaptive rule's
phases) gives the learning-rate scheduler its phases and the run its description; ``accum.adaptive`` decides each
next global batch from the noise-scale monitor's estimate.
"""

from __future__ import annotations

from typing import Any, ClassVar, cast

from torch.optim.lr_scheduler import LambdaLR

from distaccum.batching.adaptive import AdaptiveBatch
from distaccum.batching.growth import describe_growth, growth_summary
from distaccum.features.base import Assembly, Engine, SetupBase, TrainState
from distaccum.optim import rescale


class GrowthSetup(SetupBase):
    """On when the global batch is not one constant (``resolved.data.growth``)."""

    name: ClassVar[str] = "batch_growth"

    def enabled(self, run: Assembly) -> bool:
        return run.resolved.data.growth is not None

    def with_engine(self, run: Assembly, engine: Engine) -> None:
        growth, cfg = run.resolved.data.growth, run.cfg
        assert growth is not None
        run.batches = [list(p) for p in growth.phases]
        rule = cfg.accum.adaptive if cfg.accum.adaptive.enabled else None
        split, steps = run.resolved.split, cfg.trainer.max_steps
        run.describe_steps = lambda _lr: describe_growth(growth, split, steps, cfg.optim, rule)

    def summarize(self, run: Assembly, state: TrainState, summary: dict[str, Any]) -> None:
        growth = run.resolved.data.growth  # what the run's steps took, not the configured end
        assert growth is not None
        summary.update(growth_summary(growth, state.records, summary["world_size"]))


class AdaptiveSetup(SetupBase):
    """``accum.adaptive`` with the noise scale measured (``log.gns``): the next global batch from its estimate."""

    name: ClassVar[str] = "adaptive_batch"

    def enabled(self, run: Assembly) -> bool:
        cfg = run.cfg
        return cfg.log.gns and cfg.accum.adaptive.enabled and run.resolved.data.growth is not None

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        cfg, resolved = run.cfg, run.resolved
        scheduler = cast(LambdaLR, state.scheduler)  # build_scheduler's (through the seam)
        growth, gns = resolved.data.growth, run.noise_scale
        assert growth is not None and gns is not None, "the noise-scale monitor attaches first"
        order = resolved.data.order(run.components.dataset, resolved.global_batch)
        split = resolved.split
        run.monitors.append(
            AdaptiveBatch(
                cfg.accum.adaptive,
                growth,
                gns,
                lambda step: order.rank_sizes(step, split, 0)[1],
                lambda first, batch: rescale(scheduler, first, batch, cfg.optim),
                unit=split.micro_batch * split.world_size,
                global_batch=resolved.global_batch,
                max_steps=cfg.trainer.max_steps,
                rank=run.rank,
                world_size=run.world,
                device=run.device,
                group=run.group,
            )
        )
