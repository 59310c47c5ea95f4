"""distaccum: distributed training with gradient accumulation that reduces once per effective batch.

The Python API (for your own ``torchrun`` script)::

    from distaccum import Trainer, losses
    Trainer({"accum": {"micro_batch": 4, "global_batch": 64}, "run_dir": "runs/x"},
            model=make_model, dataset=ds, loss=losses.token_cross_entropy).fit()

Names are imported on first use, so ``import distaccum`` (and ``distaccum --help``) stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "Trainer": "distaccum.trainer",
    "apply_activation_checkpointing": "distaccum.activation_checkpointing",
    "Components": "distaccum.components",
    "RunConfig": "distaccum.config",
    "from_mapping": "distaccum.config",
    "StopFlag": "distaccum.runtime.stopping",
    "StopRequested": "distaccum.runtime.stopping",
    "load_weights": "distaccum.rundir.weights",
    "losses": "distaccum.losses",
}
__all__ = ["__version__", *_EXPORTS]


def load_entry(entry: str) -> Any:
    """What a registry entry ``"package.module:Name"`` names, its module imported now: the engine, launcher, feature
    and verify-rule tables name their classes this way, so that a module is imported on first use only."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def __getattr__(name: str) -> Any:
    """Lazy exports (PEP 562)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distaccum' has no attribute {name!r}")
    loaded = importlib.import_module(module)
    return loaded if module.endswith("." + name) else getattr(loaded, name)
