"""The per-step guards' set-ups: the reduction fingerprint (``trainer.fingerprint``), the reduction count and the
tripwire (every run).

The guards run below the loop and never import it (a folder is one floor), so their set-up, which takes the assembled
run, sits here beside the feature registry rather than in ``guards/``.
"""

from __future__ import annotations

from typing import ClassVar

from distaccum.features.base import Assembly, SetupBase, TrainState
from distaccum.guards.fingerprint import Fingerprint
from distaccum.guards.reduction_count import ReductionCount
from distaccum.guards.tripwire import Tripwire


class FingerprintSetup(SetupBase):
    """``trainer.fingerprint``: each step's sample of the reduced gradient compared across ranks."""

    name: ClassVar[str] = "fingerprint"

    def enabled(self, run: Assembly) -> bool:
        return run.cfg.trainer.fingerprint

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        run.fingerprint = Fingerprint(
            state.engine, run.resolved.run_dir, run.group_rank, run.world, run.device, run.group
        )


class GuardsSetup(SetupBase):
    """Every run's reduction count and tripwire (the fingerprint, when on, is checked first)."""

    name: ClassVar[str] = "guards"

    def enabled(self, run: Assembly) -> bool:
        return True

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        cfg, engine, run_dir = run.cfg, state.engine, run.resolved.run_dir
        run.monitors += [
            ReductionCount(
                engine, run_dir, run.rank, run.world
            ),  # first: it only counts, and warns before a stop
            Tripwire(
                engine,
                cfg.trainer.check_every,
                run_dir,
                record=cfg.verify.record,
                first=[run.fingerprint] if run.fingerprint is not None else [],
                group=run.group,
            ),
        ]
