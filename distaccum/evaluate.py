"""Held-out evaluation: loss and perplexity over every rank's shard, reduced by the global item count.

The eval set (a map-style dataset) is cut into ``world`` contiguous shards, one per rank; each rank
runs its shard in micro-batches of ``micro_batch`` samples and sums ``loss_sum`` and ``n_items`` in
fp64; one all-reduce adds them over ranks, and

    eval_loss = sum of the loss over every held-out item / the number of those items

so the number is the same for any split of the training batch (it does not even depend on the
eval micro-batch, up to floating-point summation order). ``eval_ppl = exp(eval_loss)``. Every rank
runs the same number of forwards (a short shard repeats its first sample with weight 0): FSDP's
forward gathers parameters, a collective every rank must join. Nothing here trains: dropout is off
(``model.eval()``) and no gradient is kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from distaccum.config import EvalConfig
from distaccum.data.pipeline import to_device
from distaccum.losses import LossFn
from distaccum.rundir import Record


@dataclass(frozen=True)
class EvalResult:
    """One evaluation, identical on every rank."""

    loss: float
    """Summed loss over every held-out item / their count."""
    items: int
    samples: int
    seconds: float

    @property
    def ppl(self) -> float:
        """Perplexity ``exp(loss)`` (inf when it overflows)."""
        return math.exp(self.loss) if self.loss < 700 else math.inf

    def record(self, step: int) -> Record:
        """The ``metrics.jsonl`` line: ``step`` is the optimizer steps done when it ran (0: before training)."""
        return {
            "step": step,
            "eval_loss": self.loss,
            "eval_ppl": self.ppl,
            "eval_items": self.items,
            "eval_samples": self.samples,
            "eval_s": self.seconds,
        }


def eval_dataset(config: EvalConfig, dataset: Any, given: Dataset | None) -> Dataset | None:
    """The held-out dataset: ``given`` (``eval.dataset`` or the Trainer's ``eval_dataset``), else the
    training dataset's ``held_out()`` split when it offers one. ValueError when evaluation is asked for
    (``eval.every`` or ``eval.at_start``) but there is no such data, or the split is empty."""
    if given is None:
        held_out = getattr(dataset, "held_out", None)
        given = held_out() if callable(held_out) else None
    wanted = config.every > 0 or config.at_start
    if given is None:
        if wanted:
            raise ValueError(
                f"eval.every={config.every} / eval.at_start={config.at_start} ask for an evaluation but "
                "there is no held-out data: set eval.dataset (a _target_ node), pass eval_dataset= to "
                "the Trainer, or use a dataset with a held-out split (data=text_files: "
                "data.dataset.eval_fraction=0.05 or data.dataset.eval_files=[...]); or train without "
                "evaluation: eval.every=0 eval.at_start=false"
            )
        return None
    try:
        size = len(given)  # type: ignore[arg-type]
    except TypeError as err:
        raise ValueError(
            f"the eval dataset {type(given).__name__} has no len(): evaluation needs a map-style dataset"
        ) from err
    if size == 0:
        raise ValueError(
            f"the eval dataset {type(given).__name__} holds no samples: give held-out data with at "
            "least one sample"
        )
    return given


def shard_batches(size: int, world: int, rank: int, micro_batch: int) -> list[torch.Tensor]:
    """This rank's eval micro-batches (index tensors); every rank gets the same number, some maybe empty."""
    shards = torch.tensor_split(torch.arange(size), world)
    count = max(math.ceil(len(s) / micro_batch) for s in shards)
    mine = list(torch.split(shards[rank], micro_batch)) if len(shards[rank]) else []
    return mine + [torch.empty(0, dtype=torch.long)] * (count - len(mine))


def evaluate(
    model: nn.Module,
    dataset: Dataset,
    collate: Callable[[list[Any]], Any],
    loss_fn: LossFn,
    *,
    micro_batch: int,
    device: torch.device,
    float_dtype: torch.dtype | None = None,
    forward_context: Callable[[], AbstractContextManager[Any]] | None = None,
) -> EvalResult:
    """Evaluate ``model`` (the wrapped one: its forward may be collective) on this rank's shard of
    ``dataset`` and reduce over the process group. Collective: every rank calls it at the same step."""
    started = time.perf_counter()
    rank, world = dist.get_rank(), dist.get_world_size()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, items, samples
    was_training = model.training
    model.eval()
    try:
        # A compiled model (trainer.compile) evaluates eagerly: no-grad evaluation would compile new graphs
        # (another guard) for a forward that runs a few times per run.
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            for piece in shard_batches(len(dataset), world, rank, micro_batch):  # type: ignore[arg-type]
                indices = piece.tolist() if len(piece) else [0]
                batch = to_device(collate([dataset[i] for i in indices]), device, float_dtype)
                with forward_context() if forward_context is not None else torch.no_grad():
                    summed, n_items = loss_fn(model, batch)
                weight = 1.0 if len(piece) else 0.0
                totals += torch.stack(
                    [
                        summed.detach().to(torch.float64) * weight,
                        torch.as_tensor(n_items, device=device).to(torch.float64) * weight,
                        torch.tensor(float(len(piece)), dtype=torch.float64, device=device),
                    ]
                )
    finally:
        model.train(was_training)
    dist.all_reduce(totals)
    loss_sum, items, samples = totals.tolist()
    return EvalResult(
        loss_sum / items if items else math.nan, round(items), round(samples), time.perf_counter() - started
    )
