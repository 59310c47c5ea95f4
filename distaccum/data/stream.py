"""Streaming data: an ``IterableDataset`` cut into windows of ``global_batch`` samples, split across ranks.

A stream has no length and no random access, so the global-batch order of :mod:`distaccum.data.global_batch`
cannot index it. Instead :class:`StreamWindows` reads the stream in order and cuts it into windows
of ``global_batch`` samples: window ``s`` of an epoch is samples ``s*G .. s*G+G-1`` of that epoch,
whatever the split. The last window of an epoch is partial (or dropped with ``data.drop_last``);
then the stream is read again from its start (``set_epoch(epoch)`` first, when the dataset has it).

Every rank reads the whole stream and keeps only its own pieces of each window (the same
``[micro][rank]`` layout as :meth:`distaccum.data.global_batch.Window.rank_micro_batches`), so every split of the
same global batch trains the same samples at the same step — and an unshuffled map-style dataset
holding the same samples gives bit-identical micro-batches. Reading is repeated on every rank; only
the training is split. (Sharding the files by rank instead would make the sample order depend on
the world size.)

Normalization needs no look-ahead: the loop backpropagates each micro-batch's summed loss and
divides by the window's item count N only at the boundary, after one all-reduce (see
:mod:`distaccum.loop`), so a stream — whose N is unknown until its micro-batches ran — is exact
without prefetching the window.

Resume: the checkpoint holds (epoch, window within the epoch); a resumed run reads that epoch's
stream again and skips the windows already trained (re-reading O(position) samples once), which is
exact for any deterministic stream. (``datasets``' own ``state_dict`` would skip the re-reading,
but it does not restore a shuffle buffer's content, and a user's stream may have no state at all.)
With ``data.num_workers > 0`` the stream is read through a ``DataLoader``: ``datasets`` streams give
each worker its own files, which changes the order with the worker count (never with the split).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeGuard

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from distaccum.config import Split
from distaccum.data.global_batch import Window
from distaccum.data.pipeline import MicroBatch, WindowBatches, ignore_stop_signals, to_device


def is_stream(dataset: Any) -> TypeGuard[IterableDataset]:
    """A dataset served by :class:`StreamSource` (an ``IterableDataset``) rather than the order."""
    return isinstance(dataset, IterableDataset)


@dataclass(frozen=True)
class StreamWindow:
    """One window of the global stream."""

    epoch: int
    index: int
    """0-based window within its epoch."""
    samples: list[Any]


def _identity(sample: Any) -> Any:
    return sample


class StreamWindows:
    """The global stream in windows of ``global_batch`` samples, epoch after epoch, from ``(epoch, index)``."""

    def __init__(
        self,
        dataset: IterableDataset,
        global_batch: int,
        *,
        drop_last: bool = False,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        epoch: int = 0,
        index: int = 0,
    ) -> None:
        self.dataset, self.global_batch, self.drop_last = dataset, global_batch, drop_last
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.epoch, self.index = epoch, index

    def _samples(self, epoch: int) -> Iterator[Any]:
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        if not self.num_workers:
            return iter(self.dataset)
        return iter(
            DataLoader(
                self.dataset,
                batch_size=None,
                collate_fn=_identity,
                num_workers=self.num_workers,
                prefetch_factor=self.prefetch_factor,
                worker_init_fn=ignore_stop_signals,
            )
        )

    def __iter__(self) -> Iterator[StreamWindow]:
        epoch, index = self.epoch, self.index
        while True:
            samples = self._samples(epoch)
            skipped = sum(1 for _ in islice(samples, index * self.global_batch))  # resume: the windows done
            served = 0
            while True:
                chunk = list(islice(samples, self.global_batch))
                full = len(chunk) == self.global_batch
                if full or (chunk and not self.drop_last):
                    yield StreamWindow(epoch, index, chunk)
                    served += 1
                    index += 1
                if not full:
                    break
            if not served and not skipped:
                raise ValueError(
                    f"the stream {type(self.dataset).__name__} yields no window in epoch {epoch}"
                    + (
                        f" (fewer than global_batch={self.global_batch} samples with data.drop_last=true)"
                        if self.drop_last
                        else " (it is empty)"
                    )
                )
            epoch, index = epoch + 1, 0


class StreamSource:
    """A :class:`~distaccum.data.pipeline.WindowSource` over an ``IterableDataset``: this rank's pieces of
    each window of the global stream, collated one micro-batch at a time as the loop asks."""

    def __init__(
        self,
        dataset: IterableDataset,
        collate: Callable[[list[Any]], Any] | None,
        split: Split,
        rank: int,
        *,
        drop_last: bool = False,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        device: torch.device | None = None,
        float_dtype: torch.dtype | None = None,
    ) -> None:
        self.dataset, self.collate, self.split, self.rank = dataset, collate or default_collate, split, rank
        self.device, self.float_dtype = device if device is not None else torch.device("cpu"), float_dtype
        self.options: dict[str, Any] = {
            "drop_last": drop_last,
            "num_workers": num_workers,
            "prefetch_factor": prefetch_factor,
        }
        self.next_step = 0
        self.epoch = 0
        self.index = 0
        """(epoch, window within it) that :meth:`window` serves next."""
        self._windows: Iterator[StreamWindow] | None = None
        self._current: StreamWindow | None = None

    def window(self) -> WindowBatches:
        if self._windows is None:
            self._windows = iter(
                StreamWindows(
                    self.dataset, self.split.global_batch, epoch=self.epoch, index=self.index, **self.options
                )
            )
        if self._current is None:  # a window not yet stepped is served again (a retried step)
            self._current = next(self._windows)
        current = self._current
        count = len(current.samples)
        layout = Window(self.next_step, current.epoch, torch.arange(count), self.split.global_batch)
        pieces = layout.rank_micro_batches(self.split, self.rank)
        collate, device, float_dtype = self.collate, self.device, self.float_dtype

        def micro() -> Iterator[MicroBatch]:
            for piece in pieces:
                # An empty piece still needs a forward/backward: the window's first sample, weight 0.
                chosen = piece.tolist() if len(piece) else [0]
                batch = collate([current.samples[i] for i in chosen])
                yield MicroBatch(to_device(batch, device, float_dtype), len(piece))

        return WindowBatches(self.next_step, current.epoch, count, layout.partial, micro(), self.split)

    def advance(self) -> None:
        assert self._current is not None, "advance() before window()"
        self.epoch, self.index = self._current.epoch, self._current.index + 1
        self.next_step += 1
        self._current = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_step": self.next_step,
            "epoch": self.epoch,
            "index": self.index,
            "global_batch": self.split.global_batch,
            "stream": type(self.dataset).__name__,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("global_batch") != self.split.global_batch or "index" not in state:
            raise ValueError(
                f"cannot resume: the checkpoint's data position ({state}) is not a stream position "
                f"with global_batch={self.split.global_batch}"
            )
        self.next_step, self.epoch, self.index = (
            int(state["next_step"]),
            int(state["epoch"]),
            int(state["index"]),
        )
        self._windows, self._current = None, None


def stream_windows(
    dataset: IterableDataset,
    global_batch: int,
    *,
    drop_last: bool = False,
    num_workers: int = 0,
    prefetch_factor: int = 2,
) -> Iterator[StreamWindow]:
    """The global windows from the start (what the single-process reference trains on)."""
    return iter(
        StreamWindows(
            dataset,
            global_batch,
            drop_last=drop_last,
            num_workers=num_workers,
            prefetch_factor=prefetch_factor,
        )
    )
