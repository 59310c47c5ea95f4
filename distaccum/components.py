"""The user's components as plain objects, and how a rank builds the model from them.

The entry layer instantiates ``_target_`` nodes into these objects; the Python API takes them
directly. Nothing here knows about Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from distaccum.activation_checkpointing import Checkpointing
from distaccum.engines.base import OptimizerFactory, Precision
from distaccum.losses import LossFn
from distaccum.probe import check_model
from distaccum.rundir.weights import load_into

ModelSpec = nn.Module | Callable[[], nn.Module]


@dataclass
class Components:
    """The user's objects: everything a run trains that is not configuration."""

    model: ModelSpec
    """An ``nn.Module``, or a zero-argument factory returning one (called once per rank after
    seeding, so every rank and every split starts from the same weights)."""
    dataset: Dataset
    """A dataset of samples: map-style (walked by the global-batch order) or an ``IterableDataset`` (a stream)."""
    loss: LossFn
    """``(model, batch) -> (loss_sum, n_items)``: see :mod:`distaccum.losses`."""
    collate: Callable[[list[Any]], Any] | None = None
    """``list[sample] -> batch``; None: ``torch.utils.data.default_collate``."""
    optimizer: OptimizerFactory | None = None
    """``params -> torch.optim.Optimizer``; None: built from the config's ``optim`` section."""
    names: dict[str, str] | None = None
    """Component -> ``_target_`` (or a description), for messages and the run's config.json."""
    activation_checkpointing: Checkpointing = None
    """Modules of the model that recompute their activations in backward: None, ``"blocks"`` or
    module-name patterns (:mod:`distaccum.activation_checkpointing`); applied by the Trainer to the
    plain model before the engine wraps it, never by the verify reference."""
    eval_dataset: Dataset | None = None
    """A map-style held-out dataset; None: the dataset's ``held_out()`` split when it has one."""

    def describe(self) -> dict[str, str]:
        """What each component is, for messages and records."""

        def name(obj: Any) -> str:
            obj = getattr(obj, "func", obj)  # functools.partial
            return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"

        found = {
            "model": name(self.model),
            "dataset": name(type(self.dataset)),
            "loss": name(self.loss),
            "collate": name(self.collate or default_collate),
        }
        return {**found, **(self.names or {})}


@dataclass(frozen=True)
class ModelRecipe:
    """How every rank (and the verify reference) builds the same initial model: seed, precision, weights."""

    seed: int
    precision: Precision
    init_from: str | None = None
    """Weights loaded after building (``trainer.init_from``: safetensors, a run's ``final/``, or a ``torch.save``
    state dict)."""

    def build(self, parts: Components) -> nn.Module:
        """Seed, build the user's model, cast it for the precision, load ``init_from``."""
        return build_model(parts.model, self.seed, self.precision, self.init_from, parts.describe()["model"])


def build_model(
    spec: ModelSpec, seed: int, precision: Precision, init_from: str | None, target: str
) -> nn.Module:
    """Seed, build (or take) the model, cast it for ``precision`` (fp64), load ``init_from``."""
    torch.manual_seed(seed)  # identical initial weights on every rank and every split
    model = check_model(spec() if not isinstance(spec, nn.Module) else spec, target)
    if precision.param_dtype == torch.float64:
        model = model.double()
    if init_from:
        try:
            load_into(model, init_from)
        except ValueError as err:
            raise ValueError(f"trainer.init_from={init_from}: {err}") from err
    return model
