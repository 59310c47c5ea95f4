"""Outer sync's set-up: the islands (each island's ranks) before the engine exists, the outer step once the
engine has wrapped the model.

Every per-step collective of an outer-synced run (the window's, the checks') stays inside this rank's island; only
the outer step crosses between islands.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from distaccum.features.base import Assembly, Engine, Placement, SetupBase, TrainState
from distaccum.outer.islands import IslandLayout, Islands
from distaccum.outer.sync import OuterSync


class OuterSetup(SetupBase):
    """On when the run has islands (``outer.method`` other than none)."""

    name: ClassVar[str] = "outer"

    def __init__(self) -> None:
        self.islands: Islands | None = None

    def enabled(self, run: Assembly) -> bool:
        return bool(run.resolved.outer_islands)

    def before_engine(self, run: Assembly) -> None:
        """The islands and their groups (collective), shown once by rank 0."""
        resolved = run.resolved
        layout = IslandLayout.of(resolved.world_size, resolved.rank, resolved.outer_islands)
        islands = self.islands = Islands.build(layout, run.device)
        outer = run.cfg.outer
        run.announce(f"distaccum: islands merged every {outer.every} optimizer steps ({outer.describe()})")
        run.spec = dataclasses.replace(run.spec, islands=islands)
        run.group, run.world, run.group_rank = islands.inner_group, layout.size, layout.inner_rank
        run.host_group = islands.host_group
        groups = layout.groups()
        run.placement = Placement(
            groups,
            f"{len(groups)} islands of {len(groups[0])} rank(s) (each island's own reductions)",
            "island",
            "outer.islands",
        )

    def with_engine(self, run: Assembly, engine: Engine) -> None:
        assert self.islands is not None
        sync = OuterSync(
            run.cfg.outer,
            self.islands,
            engine.unwrapped(),
            engine.replicated_gradients,
            run.cfg.trainer.max_steps,
        )
        run.outer = run.seam("outer", sync)

    def summarize(self, run: Assembly, state: TrainState, summary: dict[str, Any]) -> None:
        summary["outer"] = state.outer.summary(state.records)
