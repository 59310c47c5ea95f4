"""Telemetry's set-ups: the straggler view (every run), the gradient noise scale (``log.gns``) and the compile watch
(``trainer.compile``), each a step monitor with its own cadence."""

from __future__ import annotations

from typing import ClassVar

from distaccum.features.base import Assembly, SetupBase, TrainState
from distaccum.telemetry.gns import GnsMonitor
from distaccum.telemetry.timing import RankStats


class RankStatsSetup(SetupBase):
    """Every run's straggler view (``log.rank_stats_every``)."""

    name: ClassVar[str] = "rank_stats"

    def enabled(self, run: Assembly) -> bool:
        return True

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        run.monitors.append(RankStats(run.timer, run.cfg.log.rank_stats_every))


class GnsSetup(SetupBase):
    """``log.gns``: the noise scale from the gradients the comm hook reduces once per step."""

    name: ClassVar[str] = "gns"

    def enabled(self, run: Assembly) -> bool:
        return run.cfg.log.gns

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        cfg = run.cfg
        adaptive = cfg.accum.adaptive.enabled  # decides on the step's estimate before the next step
        monitor = GnsMonitor(
            state.engine.grad_squares,
            cfg.log.gns_ema,
            run.world,
            run.rank,
            run.device,
            eager_after=state.records if adaptive else None,
        )
        run.noise_scale = run.seam("gns", monitor)
        run.monitors.append(run.noise_scale)


class CompileWatchSetup(SetupBase):
    """``trainer.compile``: compile time, recompiles and graph breaks per step."""

    name: ClassVar[str] = "compile_watch"

    def enabled(self, run: Assembly) -> bool:
        return run.cfg.trainer.compile

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        # imports dynamo (about 2 s): only when compiling, never in the launching process
        from distaccum.telemetry.compilation import CompileWatch

        run.monitors.append(CompileWatch(run.rank, warmup_steps=max(done, 0) + 1))
