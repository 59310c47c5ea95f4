"""The typed ``verify`` section: which candidates `distaccum verify` launches and its tolerances (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports it) to keep that module under 500 lines; like
:mod:`distaccum.split` it imports nothing of distaccum but the shared checks in :mod:`distaccum.units`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distaccum.units import check_choice, check_positive


@dataclass(kw_only=True)
class VerifyConfig:
    """`distaccum verify`: candidates and tolerances."""

    splits: str = "config"
    """config: only the configured split; auto: every valid split up to max_candidates."""
    max_candidates: int = 4
    """Upper bound on candidates with splits=auto."""
    reference_dtype: str = "same"
    """same: reference in the run's precision; fp64: reference in fp64 to separate rounding from bugs."""
    rtol: float | None = None
    """Relative tolerance; null picks the default for the precision."""
    atol: float | None = None
    """Absolute tolerance; null picks the default for the precision."""
    record: bool = False
    """Write per-step parameter digests (param_digests.jsonl) to run_dir. distaccum verify sets it for
    the runs it launches."""

    def __post_init__(self) -> None:
        check_choice("verify", "splits", self.splits, ("config", "auto"))
        check_choice("verify", "reference_dtype", self.reference_dtype, ("same", "fp64"))
        check_positive("verify", "max_candidates", self.max_candidates)
