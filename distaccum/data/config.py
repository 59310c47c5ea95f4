"""The typed ``data`` and ``eval`` sections: the training dataset, how the global-batch order walks it, and the
held-out data evaluated beside it (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports them) to keep that module under 500 lines; like
:mod:`distaccum.split` it imports nothing of distaccum but the shared checks in :mod:`distaccum.units`. What the
settings do is :mod:`distaccum.data.pipeline` and :mod:`distaccum.evaluate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distaccum.units import Node, check_node, check_positive


@dataclass(kw_only=True)
class DataConfig:
    """The dataset (a component) and how the global-batch order walks it."""

    dataset: Node | None = None
    """_target_ node of a torch Dataset of samples: map-style (``len`` and ``[i]``, walked by the global-batch
    order) or an IterableDataset (a stream, cut into windows in order)."""
    collate: Node | None = None
    """_target_ node (with ``_partial_: true``) of ``list[sample] -> batch``; null: torch's default_collate."""
    shuffle: bool = True
    """Reshuffle each epoch from (trainer.seed, epoch) (map-style datasets; a stream keeps its own order)."""
    drop_last: bool = False
    """Drop a partial last window (True) or train on it, weighted by what it holds (False)."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: collate in the training process; a plain in-memory
    `TensorDataset` is then cut without a DataLoader). A stream is read through them (samples; collated in the training process)."""
    prefetch_factor: int = 2
    """Micro-batches (stream: samples) each DataLoader worker prepares ahead (only with num_workers > 0)."""

    def __post_init__(self) -> None:
        self.dataset = check_node("data.dataset", self.dataset)
        self.collate = check_node("data.collate", self.collate)
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        check_positive("data", "prefetch_factor", self.prefetch_factor)


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation: loss and perplexity over every rank's shard, reduced by the global item count."""

    dataset: Node | None = None
    """_target_ node of a map-style held-out dataset; null: the training dataset's held_out() split when
    it has one (data=text_files: data.dataset.eval_fraction or data.dataset.eval_files), else no evaluation."""
    every: int = 0
    """Evaluate every N optimizer steps (0: not during training)."""
    at_start: bool = False
    """Also evaluate before the first optimizer step (step 0)."""
    at_end: bool = True
    """Evaluate after the last optimizer step (when there is held-out data); the result goes to summary.json."""
    micro_batch: int | None = None
    """Samples per eval forward per rank; null: accum.micro_batch."""

    def __post_init__(self) -> None:
        self.dataset = check_node("eval.dataset", self.dataset)
        if self.every < 0:
            raise ValueError(f"eval.every must be >= 0, got {self.every}")
        check_positive("eval", "micro_batch", self.micro_batch, allow_none=True)
