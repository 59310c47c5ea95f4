"""Check the user's components before training: types, an empty dataset, collate, and the loss contract.

The normalization probe: on one sample s, ``loss(model, collate([s, s]))`` must give twice the
``loss_sum`` and twice the ``n_items`` of ``loss(model, collate([s]))``. A loss that returns a mean
gives the same value for both, and would make distaccum's division by the global item count
divide twice — the probe catches it before any worker starts. Models with batch-statistics layers
(BatchNorm) make the two values legitimately differ, so for them only the item count is checked.

Every failure is a ``ValueError`` naming the component's ``_target_`` and the fix.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from distaccum.data.pipeline import to_device
from distaccum.losses import LossFn
from distaccum.models import batch_stat_layers

_EMPTY = object()


@dataclass(frozen=True)
class ProbeReport:
    """What the probe measured on sample 0."""

    loss_one: float
    loss_two: float
    items_one: float
    items_two: float
    checked_sum: bool
    """False when batch-statistics layers made the loss comparison meaningless (skipped)."""


def _scalar(value: Any, what: str, target: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"loss {target} returned a {what} of shape {tuple(value.shape)}; it must be a "
                "scalar: sum the loss over the batch (reduction='sum')"
            )
        return float(value.detach())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    raise ValueError(
        f"loss {target} returned a {what} of type {type(value).__name__}; expected a "
        "scalar tensor (loss_sum) and an int or scalar tensor (n_items)"
    )


def _call_loss(loss: LossFn, model: nn.Module, batch: Any, target: str) -> tuple[torch.Tensor, float, float]:
    out = loss(model, batch)
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise ValueError(
            f"loss {target} must return (loss_sum, n_items), got {type(out).__name__}"
            + (f" of length {len(out)}" if isinstance(out, tuple | list) else "")
        )
    loss_sum, n_items = out
    if not isinstance(loss_sum, torch.Tensor):
        raise ValueError(
            f"loss {target} returned loss_sum of type {type(loss_sum).__name__}; it must be a "
            "tensor connected to the model (so it can be backpropagated)"
        )
    return loss_sum, _scalar(loss_sum, "loss_sum", target), _scalar(n_items, "n_items", target)


def check_model(model: Any, target: str) -> nn.Module:
    """``model`` itself if it is an ``nn.Module``; a clear error naming the factory otherwise."""
    if not isinstance(model, nn.Module):
        raise ValueError(
            f"model {target} returned a {type(model).__name__}, not a torch.nn.Module: the "
            "_target_ must name a class or a function that builds and returns the model"
        )
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model {target} has no trainable parameters")
    return model


def probe(
    model: nn.Module,
    dataset: Dataset,
    collate: Callable[[list[Any]], Any],
    loss: LossFn,
    *,
    names: dict[str, str] | None = None,
    rtol: float = 1e-4,
) -> ProbeReport:
    """Run the component checks and the normalization probe on sample 0 (a stream's first sample);
    raise ValueError on failure. A dataset with ``check_model(model)`` checks that the model fits its
    samples (distaccum.textdata: vocabulary, positions); with ``check_loss(loss)``, that the loss does (a shift).

    ``names`` maps 'model', 'dataset', 'collate', 'loss' to their ``_target_`` for messages. The
    model runs in eval mode without gradients, and the global RNG state is restored afterwards, so
    probing changes nothing a run would see.
    """
    names = {
        "model": "(model)",
        "dataset": "(dataset)",
        "collate": "(collate)",
        "loss": "(loss)",
        **(names or {}),
    }
    stream = isinstance(dataset, IterableDataset)
    if not stream:
        try:
            size = len(dataset)  # type: ignore[arg-type]
        except TypeError as err:
            raise ValueError(
                f"dataset {names['dataset']} has no len(): distaccum's global-batch order needs a "
                "map-style dataset (__len__ and __getitem__), or a torch IterableDataset (a stream)"
            ) from err
        if size == 0:
            raise ValueError(f"dataset {names['dataset']} is empty: there is nothing to train on")
    check_fit = getattr(dataset, "check_model", None)
    if callable(check_fit):  # a dataset that knows what its samples need (vocabulary, positions)
        check_fit(model)
    check_loss = getattr(dataset, "check_loss", None)
    if callable(check_loss):  # ... and what its loss must do with them (shift the labels)
        check_loss(loss)
    with torch.random.fork_rng(devices=[]):
        try:
            sample = next(iter(dataset), _EMPTY) if stream else dataset[0]
        except Exception as err:
            raise ValueError(
                f"dataset {names['dataset']}: reading sample 0 failed: {type(err).__name__}: {err}"
            ) from err
        if sample is _EMPTY:
            raise ValueError(
                f"dataset {names['dataset']} (a stream) yields no sample: there is nothing to train on"
            )
        batches = []
        for count in (1, 2):
            try:
                batches.append(collate([sample] * count))
            except Exception as err:
                raise ValueError(
                    f"collate {names['collate']} failed on sample 0 (a batch of {count}): "
                    f"{type(err).__name__}: {err}"
                ) from err
        first = next(model.parameters())  # batches as the loop will hand them over (fp64 runs: fp64 floats)
        batches = [
            to_device(b, first.device, torch.float64 if first.dtype == torch.float64 else None)
            for b in batches
        ]
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                try:
                    (_, one, n_one), (_, two, n_two) = (
                        _call_loss(loss, model, b, names["loss"]) for b in batches
                    )
                except ValueError:
                    raise
                except Exception as err:
                    raise ValueError(
                        f"loss {names['loss']} failed on sample 0: {type(err).__name__}: {err}"
                    ) from err
        finally:
            model.train(was_training)
    target = names["loss"]
    if n_one <= 0:
        raise ValueError(
            f"loss {target} reports n_items={n_one:g} for sample 0; every sample must hold at "
            "least one loss item (a token that is not ignored, or the sample itself)"
        )
    if n_two != 2 * n_one:
        raise ValueError(
            f"loss {target}: n_items must add up over samples, but a batch of sample 0 twice "
            f"reports {n_two:g} items and sample 0 alone {n_one:g} (expected {2 * n_one:g})"
        )
    if not (math.isfinite(one) and math.isfinite(two)):
        raise ValueError(f"loss {target} is not finite on sample 0 ({one}, {two})")
    layers = batch_stat_layers(model)
    if layers:
        warnings.warn(
            f"normalization probe: the loss-sum check is skipped for a model with batch-statistics "
            f"layers ({', '.join(layers)}), whose output depends on the batch",
            stacklevel=2,
        )
        return ProbeReport(one, two, n_one, n_two, checked_sum=False)
    if abs(two - 2 * one) > rtol * max(abs(2 * one), 1e-12):
        mean_like = abs(two - one) <= rtol * max(abs(one), 1e-12)
        raise ValueError(
            f"loss {target} does not return a sum: sample 0 alone gives loss_sum={one:.6g}, sample 0 twice "
            f"gives {two:.6g} (expected {2 * one:.6g}). "
            + ("That is a mean. " if mean_like else "")
            + "Return the SUM of the loss over the batch's loss items (e.g. reduction='sum') with their "
            "count; distaccum divides by the global item count of the whole window itself."
        )
    return ProbeReport(one, two, n_one, n_two, checked_sum=True)
