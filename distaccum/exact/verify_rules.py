"""Exact accumulation's verify rules: the reference is the same exact run in one process, and a candidate passes only
with its bits (the SHA-256 of the final parameters), not within a tolerance."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from distaccum.components import Components
from distaccum.config import RunConfig, with_overrides
from distaccum.exact.fixed_point import params_sha256
from distaccum.split import Split
from distaccum.trainer import Trainer
from distaccum.verify.compare import Report, RunData
from distaccum.verify.rules import VerifyRules


class ExactRules(VerifyRules):
    """``accum.exact=true``: bitwise against the one-process exact run of the same micro-batch."""

    name: ClassVar[str] = "exact"

    def applies(self, cfg: RunConfig) -> bool:
        return cfg.accum.exact

    def check(self, cfg: RunConfig) -> None:
        if cfg.verify.reference_dtype != "same":
            raise ValueError(
                "accum.exact=true is verified bit for bit against a reference in the run's own precision: "
                f"verify.reference_dtype={cfg.verify.reference_dtype} cannot apply; use verify.reference_dtype=same"
            )

    def reference_line(self, cfg: RunConfig, precision: str) -> str | None:
        return (
            f"  reference: accum.exact in one process (the candidates' micro-batch, K = pieces per step), {precision}, "
            "the same seed checkpoint, samples, optimizer and schedule"
        )

    def tolerance_line(self, cfg: RunConfig) -> str | None:
        return (
            "  compared bit for bit: the SHA-256 of the final parameters (records within the tolerance too)"
        )

    def run_reference(self, ref: RunConfig, parts: Components, run_dir: Path, split: Split) -> bool:
        pieces = split.global_batch // split.micro_batch
        cfg = with_overrides(ref, {"accum.micro_batch": split.micro_batch, "accum.steps": pieces})
        Trainer.of(cfg, parts, check_components=False).fit()
        return True

    def judge(self, report: Report, ref: RunData, cand: RunData) -> Report:
        if ref.params is None or cand.params is None:
            return report
        theirs, ours = params_sha256(ref.params.items()), params_sha256(cand.params.items())
        if theirs == ours:
            return dataclasses.replace(report, bitwise=True)
        note = f"accum.exact: the final parameters' SHA-256 {ours[:12]} differs from the reference's {theirs[:12]}"
        return dataclasses.replace(report, passed=False, notes=[*report.notes, note])
