"""Outer sync's rules for ``distaccum verify``: the islands' simulator as the reference (:mod:`distaccum.outer.simulate`),
the configured split only (the islands are cut from it), no replays (they know one reduction per step, not the
islands' merges), the first merge measured against the simulator's for the diagnosis, and no compressed merge."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from distaccum.components import Components
from distaccum.config import RunConfig
from distaccum.outer.simulate import run_outer_reference
from distaccum.split import Split
from distaccum.verify.diagnosis import StepFacts
from distaccum.verify.outer_merge import outer_merge_fact
from distaccum.verify.rules import Diverged, VerifyRules


class OuterRules(VerifyRules):
    """On for an outer-synced configuration (``outer.method`` other than none)."""

    name: ClassVar[str] = "outer"
    fixed_split: ClassVar[bool] = True
    replays: ClassVar[bool] = False

    def applies(self, cfg: RunConfig) -> bool:
        return cfg.outer.enabled

    def check(self, cfg: RunConfig) -> None:
        if cfg.outer.reduce_dtype != "fp32":
            raise ValueError(
                f"outer.reduce_dtype={cfg.outer.reduce_dtype} rounds every merge, and verify has no derived bound "
                "for that rounding yet: verify the run with outer.reduce_dtype=fp32 (the same math uncompressed)"
            )

    def reference_line(self, cfg: RunConfig, precision: str) -> str | None:
        return (
            f"  reference: {cfg.outer.method} simulated in one process, each island's samples of a step in one "
            f"forward/backward, island after island, then the merge, {precision}, the same seed checkpoint, "
            "samples, optimizers and schedule"
        )

    def run_reference(self, ref: RunConfig, parts: Components, run_dir: Path, split: Split) -> bool:
        run_outer_reference(
            ref, parts, run_dir, split=split
        )  # the islands' simulator, on the split they are cut from
        return True

    def explain(self, case: Diverged, facts: StepFacts) -> StepFacts:
        if case.seed is None:  # the first merge is measured from the seed checkpoint
            return facts
        merge = outer_merge_fact(
            case.cfg, case.split.world_size, case.seed, case.report, case.ref.digests, case.cand.digests
        )
        return dataclasses.replace(facts, outer_merge=merge)
