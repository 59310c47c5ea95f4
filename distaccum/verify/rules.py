"""A feature's rules for ``distaccum verify``, behind one small protocol, and their registry.

What a candidate's config needs, what the plain reference must do differently, what the diagnosis may add, and what
verify refuses: each feature says so in its own room (``outer/verify_rules.py``, ``batching/verify_rules.py``), and
the runner asks the rules of the features a configuration turns on, never the feature by name. Rule modules are
imported on first use, as the engines and the feature set-ups are (:mod:`distaccum.features`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from distaccum import load_entry
from distaccum.components import Components
from distaccum.config import RunConfig
from distaccum.split import Split
from distaccum.verify.compare import Report, RunData
from distaccum.verify.diagnosis import StepFacts

RULES: dict[str, str] = {
    "outer": "distaccum.outer.verify_rules:OuterRules",
    "ramp": "distaccum.batching.verify_rules:RampRules",
    "adaptive_batch": "distaccum.batching.verify_rules:AdaptiveRules",
    "exact": "distaccum.exact.verify_rules:ExactRules",
}
"""Feature name -> ``module:Class`` of its :class:`VerifyRules`."""


@dataclass(frozen=True)
class Diverged:
    """A candidate verify is diagnosing, as a feature's rules see it (:meth:`VerifyRules.explain`)."""

    cfg: RunConfig
    """The configuration verify checks."""
    split: Split
    """The candidate's split."""
    seed: Path | None
    """The checkpoint every run started from, when known."""
    report: Report
    """The candidate's comparison with the reference."""
    ref: RunData
    cand: RunData


class VerifyRules:
    """A feature's rules for verify; the defaults are the plain ones (a candidate as configured, the plain
    reference, the replays of step 1)."""

    name: ClassVar[str] = "?"
    fixed_split: ClassVar[bool] = False
    """``verify.splits=auto`` adds no other split (the feature's layout depends on the configured split)."""
    replays: ClassVar[bool] = True
    """Step 1's replays (one reduction per step, combined each known wrong way) apply to the feature's runs."""

    def applies(self, cfg: RunConfig) -> bool:
        """Whether ``cfg`` turns the feature on."""
        raise NotImplementedError

    def check(self, cfg: RunConfig) -> None:
        """Raise ValueError when verify cannot take the feature as configured (before anything runs)."""
        return None

    def accum_at(self, cfg: RunConfig, split: Split) -> dict[str, Any]:
        """The ``accum`` fields a run's config at ``split`` (the reference's or a candidate's) needs for the feature,
        besides the split's own (``micro_batch``, ``steps``; ``global_batch`` is None unless a rule keeps it)."""
        return {}

    def window(self, cfg: RunConfig, global_batch: int) -> str | None:
        """The header's words for the reference's window (None: the plain global batch)."""
        return None

    def reference_line(self, cfg: RunConfig, precision: str) -> str | None:
        """The header's line for the reference, when the feature's reference is not the plain one."""
        return None

    def tolerance_line(self, cfg: RunConfig) -> str | None:
        """The header's line for the comparison, when the feature compares otherwise than within the tolerance."""
        return None

    def judge(self, report: Report, ref: RunData, cand: RunData) -> Report:
        """The candidate's report with the feature's own verdict (``accum.exact``: bit for bit)."""
        return report

    def run_reference(self, ref: RunConfig, parts: Components, run_dir: Path, split: Split) -> bool:
        """Run the feature's own reference (``ref`` is its config, ``split`` the first candidate's); False: the plain
        reference applies."""
        return False

    def explain(self, case: Diverged, facts: StepFacts) -> StepFacts:
        """The step facts of a diverged candidate (``case``), with what the feature can tell about it."""
        return facts


def rules_class(name: str) -> type[VerifyRules]:
    """The rules registered under ``name`` (imports their module)."""
    return load_entry(RULES[name])


def rules_for(cfg: RunConfig) -> list[VerifyRules]:
    """The rules of the features ``cfg`` turns on, in :data:`RULES`' order."""
    rules = [rules_class(name)() for name in RULES]
    return [r for r in rules if r.applies(cfg)]
