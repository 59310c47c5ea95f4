"""Activation checkpointing's set-up: :func:`distaccum.resolve.prepare` applies it to the model (it must, before the
engine wraps it); the run announces the modules it covers.

It sits here and not in :mod:`distaccum.activation_checkpointing`, which :mod:`distaccum.resolve` imports: a set-up
takes the resolved run, so beside the applier it would close an import cycle.
"""

from __future__ import annotations

from typing import ClassVar

from distaccum.features.base import Assembly, SetupBase


class CheckpointingSetup(SetupBase):
    """On when the prepared model has checkpointed modules; names a few of them once."""

    name: ClassVar[str] = "activation_checkpointing"

    def enabled(self, run: Assembly) -> bool:
        return bool(run.prepared.checkpointed)

    def before_engine(self, run: Assembly) -> None:
        modules = run.prepared.checkpointed
        shown = ", ".join(modules[:3]) + (", ..." if len(modules) > 3 else "")
        run.announce(
            f"distaccum: activation checkpointing (non-reentrant) on {len(modules)} modules: {shown}"
        )
