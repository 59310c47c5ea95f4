"""Where a run's windows come from: a map-style dataset through the global-batch order, or a stream.

:class:`DataOptions` is the narrow part of the configuration the data side uses (resolved once by
:func:`distaccum.resolve.resolve`); :func:`build_source` picks the source for a dataset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from distaccum.batching.growth import BatchGrowth
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.data.pipeline import OrderSource, WindowSource
from distaccum.data.stream import StreamSource, is_stream
from distaccum.split import Split


@dataclass(frozen=True)
class DataOptions:
    """How the order walks the data and how the loaders read it (``data.*`` and ``trainer.seed``)."""

    seed: int
    shuffle: bool
    drop_last: bool
    num_workers: int
    prefetch_factor: int

    growth: BatchGrowth | None = None
    """The global batch per step when it is not constant (``accum.ramp``, ``accum.adaptive``)."""

    def order(self, dataset: Dataset, global_batch: int) -> GlobalBatchOrder:
        """The global-batch order over a map-style ``dataset`` (ValueError when no window would run)."""
        return GlobalBatchOrder(
            len(dataset),  # type: ignore[arg-type]  # map-style: it has a length
            global_batch,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            growth=self.growth,
        )


def build_source(
    dataset: Dataset,
    collate: Callable[[list[Any]], Any] | None,
    split: Split,
    rank: int,
    max_steps: int,
    options: DataOptions,
    *,
    device: torch.device | None = None,
    float_dtype: torch.dtype | None = None,
) -> WindowSource:
    """This rank's windows for training on ``device`` (default the CPU; floating tensors cast to ``float_dtype`` when
    given): a stream (no length) is cut into windows in order; a map-style dataset is walked by the global-batch
    order (through a DataLoader, pinned on CUDA, or an in-memory ``TensorDataset`` cut directly:
    :class:`~distaccum.data.pipeline.TensorRows`)."""
    if is_stream(dataset):
        if options.growth is not None:
            raise ValueError(
                "accum.ramp / accum.adaptive need a map-style dataset (with a length): a stream's windows are cut "
                "at a fixed global batch; wrap the data in a map-style Dataset, or train at one global batch"
            )
        return StreamSource(
            dataset,
            collate,
            split,
            rank,
            drop_last=options.drop_last,
            num_workers=options.num_workers,
            prefetch_factor=options.prefetch_factor,
            device=device,
            float_dtype=float_dtype,
        )
    return OrderSource(
        dataset,
        collate,
        options.order(dataset, split.global_batch),
        split,
        rank,
        max_steps,
        device=device,
        num_workers=options.num_workers,
        prefetch_factor=options.prefetch_factor,
        float_dtype=float_dtype,
    )
