"""Feature registry: each optional part of a run (outer sync, a growing batch, a per-step check, ...) builds its own
parts from the resolved run, behind :class:`~distaccum.features.base.FeatureSetup`.

Like :data:`distaccum.engines.ENGINES`, set-up modules are imported on first use (``importlib``), so a feature's folder
never imports this registry and the registry names no feature's module at import time. Add a feature by writing its
set-up (a :class:`~distaccum.features.base.SetupBase` subclass in the feature's own folder) and a line in
:data:`FEATURES`; the Trainer composes the run from the table without naming the feature.
"""

from __future__ import annotations

from distaccum import load_entry
from distaccum.features.base import Assembly, FeatureSetup, Placement, SetupBase

__all__ = ["FEATURES", "Assembly", "FeatureSetup", "Placement", "SetupBase", "feature_setups"]

FEATURES: dict[str, str] = {
    "activation_checkpointing": "distaccum.features.checkpointing:CheckpointingSetup",
    "outer": "distaccum.outer.setup:OuterSetup",
    "exact": "distaccum.exact.setup:ExactSetup",
    "ft": "distaccum.ft.setup:FtSetup",
    "batch_growth": "distaccum.batching.setup:GrowthSetup",
    "fingerprint": "distaccum.features.guards:FingerprintSetup",
    "guards": "distaccum.features.guards:GuardsSetup",
    "rank_stats": "distaccum.telemetry.setup:RankStatsSetup",
    "gns": "distaccum.telemetry.setup:GnsSetup",
    "adaptive_batch": "distaccum.batching.setup:AdaptiveSetup",
    "compile_watch": "distaccum.telemetry.setup:CompileWatchSetup",
}
"""Feature name -> ``module:Class``, in the order their parts attach (the step monitors run in this order: the
reduction count first, it only counts and warns before a stop)."""


def setup_class(name: str) -> type[SetupBase]:
    """The set-up class registered under ``name`` (imports its module)."""
    return load_entry(FEATURES[name])


def feature_setups(run: Assembly) -> list[FeatureSetup]:
    """The set-ups of the features that are on for ``run``, in :data:`FEATURES`' order."""
    setups = [setup_class(name)() for name in FEATURES]
    return [s for s in setups if s.enabled(run)]
