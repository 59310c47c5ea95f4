"""The batch growth's rules for ``distaccum verify``: a ramp's runs keep the global batch it ends at (the reference
takes each step's window whole all the same); the adaptive rule is refused (its global batch follows each run's own
noise estimate, which no reference shares: :data:`~distaccum.batching.adaptive.VERIFY_RECIPE`)."""

from __future__ import annotations

from typing import Any, ClassVar

from distaccum.batching.adaptive import VERIFY_RECIPE
from distaccum.batching.growth import BatchGrowth
from distaccum.config import RunConfig
from distaccum.split import Split
from distaccum.verify.rules import VerifyRules


class RampRules(VerifyRules):
    """On for ``accum.ramp``."""

    name: ClassVar[str] = "ramp"

    def applies(self, cfg: RunConfig) -> bool:
        return cfg.accum.ramp.enabled

    def accum_at(self, cfg: RunConfig, split: Split) -> dict[str, Any]:
        return {"global_batch": split.global_batch}  # a ramp ends at the global batch

    def window(self, cfg: RunConfig, global_batch: int) -> str | None:
        ramp = BatchGrowth.of(cfg.accum.ramp, global_batch)
        return f"each step's global batch of accum.ramp, {', '.join(str(b) for _, b in ramp.phases)} samples"


class AdaptiveRules(VerifyRules):
    """On for ``accum.adaptive``: refused."""

    name: ClassVar[str] = "adaptive_batch"

    def applies(self, cfg: RunConfig) -> bool:
        return cfg.accum.adaptive.enabled

    def check(self, cfg: RunConfig) -> None:
        raise ValueError(VERIFY_RECIPE)
