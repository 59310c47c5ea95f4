"""The loss contract and ready-made losses.

A loss is ``loss(model, batch) -> (loss_sum, n_items)``: it runs the model on the batch and returns
the SUM of the loss over the batch's ``n_items`` loss items (non-ignored tokens, or samples) —
never a mean. distaccum divides by the global item count of the whole window over all ranks,
which is the only normalization that makes accumulated gradients equal to the full-batch gradient
when micro-batches hold different numbers of items. ``distaccum train`` checks the contract before
any worker starts (:mod:`distaccum.probe`). In YAML, name a loss with ``_partial_: true``:

    _target_: distaccum.losses.token_cross_entropy
    _partial_: true
    ignore_index: -100
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100

LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, "torch.Tensor | int"]]
"""``(model, batch) -> (loss_sum, n_items)``."""


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model output: a tensor, a Hugging Face ``ModelOutput`` (``.logits``) or a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"cannot find logits in a model output of type {type(output).__name__}")


def _pair(batch: Any) -> tuple[Any, torch.Tensor]:
    """(inputs, targets) of a batch given as a 2-sequence or a mapping with 'inputs'/'targets'."""
    if isinstance(batch, Mapping):
        return batch["inputs"], batch["targets"]
    inputs, targets = batch
    return inputs, targets


def token_cross_entropy(
    model: nn.Module,
    batch: Mapping[str, torch.Tensor],
    *,
    ignore_index: int = IGNORE_INDEX,
    shift: bool = False,
    label_key: str = "labels",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over the labels that are not ``ignore_index``.

    ``batch`` is a mapping: every key but ``label_key`` is passed to the model as a keyword
    (``input_ids``, ``attention_mask``, ...), so the model never computes a loss of its own.
    ``shift=True`` follows the Hugging Face convention (labels equal the inputs; position t predicts
    label t+1); ``shift=False`` expects labels already aligned with the logits.
    """
    labels = batch[label_key]
    logits = logits_of(model(**{k: v for k, v in batch.items() if k != label_key}))
    if shift:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):  # autocast logits: take the softmax in fp32
        flat = flat.float()
    labels = labels.reshape(-1)
    loss = F.cross_entropy(flat, labels, ignore_index=ignore_index, reduction="sum")
    return loss, (labels != ignore_index).sum()


def sample_cross_entropy(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    """Classification: cross-entropy summed over samples; ``batch`` is ``(inputs, class_ids)``."""
    inputs, targets = _pair(batch)
    logits = logits_of(model(inputs))
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, targets, reduction="sum"), int(targets.shape[0])


def mse(model: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    """Regression: squared error summed over output features and samples; one item per sample."""
    inputs, targets = _pair(batch)
    out = logits_of(model(inputs))
    return F.mse_loss(out.to(targets.dtype), targets, reduction="sum"), int(targets.shape[0])
