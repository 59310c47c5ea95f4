"""The input pipeline: windows of micro-batches for the loop, through a ``torch.utils.data.DataLoader``.

The loop asks a :class:`WindowSource` for one window at a time: what the window holds (step,
epoch, samples over all ranks, partial or not) and this rank's K micro-batches, collated just
before each forward. :class:`OrderSource` serves a map-style dataset through the deterministic
global-batch order: each rank's DataLoader takes a batch sampler that walks the order from the
resume position, so workers (``data.num_workers``) prefetch exactly the micro-batches this rank
will train on, in order, and a resumed run continues at the exact next sample. An empty
micro-batch (a partial window spread over more pieces than it has samples) is replaced by the
window's first sample with ``samples=0``, which the loop weights zero, so every rank still runs K
forward/backward passes and takes part in every gradient reduction.

An in-memory ``TensorDataset`` without a collate or workers needs no DataLoader: :class:`TensorRows` cuts its
micro-batches in the training process (a view of consecutive rows, or one ``index_select`` per tensor), the same
batches the loader would make, without its per-batch machinery.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset, default_collate

from distaccum.config import Split
from distaccum.data.global_batch import GlobalBatchOrder


class OrderSampler(Sampler[list[int]]):
    """Yields this rank's micro-batch index lists for optimizer steps ``start .. stop - 1``."""

    def __init__(self, order: GlobalBatchOrder, split: Split, rank: int, start: int, stop: int) -> None:
        self.order, self.split, self.rank, self.start, self.stop = order, split, rank, start, stop

    def __len__(self) -> int:
        return sum(self.order.split_at(step, self.split).accum_steps for step in range(self.start, self.stop))

    def __iter__(self) -> Iterator[list[int]]:
        return (piece.tolist() for piece in self.pieces())

    def ranges(self) -> Iterator[tuple[int, int]]:
        """The same micro-batches of an unshuffled order as (first sample, count) (:meth:`GlobalBatchOrder.rank_ranges`:
        no tensor per micro-batch)."""
        for step in range(self.start, self.stop):
            yield from self.order.rank_ranges(step, self.split, self.rank)

    def pieces(self) -> Iterator[torch.Tensor]:
        """The same micro-batches as index tensors."""
        for step in range(self.start, self.stop):
            window, pieces = self.order.rank_pieces(step, self.split, self.rank)
            for piece in pieces:
                # An empty piece still needs a forward/backward (the loop weights it 0).
                yield piece if len(piece) else window.indices[:1]


def ignore_stop_signals(worker_id: int) -> None:
    """``worker_init_fn`` of distaccum's DataLoaders: SIGTERM/SIGUSR1 are the training process's to handle.

    torch elastic and Slurm signal a rank's whole process group; a DataLoader worker killed by it
    would crash its rank ("DataLoader worker exited unexpectedly") before the rank finished the
    window and wrote its checkpoint. The workers hold no state of their own and exit with their rank
    (the DataLoader's watchdog sees the parent go).
    """
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


class TensorBatches(Dataset):
    """A ``TensorDataset`` served a micro-batch at a time: DataLoader's batched fetch (``__getitems__``) takes
    each tensor's rows with one ``index_select`` instead of one ``__getitem__`` per sample and a stack (256
    samples of two tensors: 512 indexing calls and two stacks of Python-made rows, against two gathers). The
    batch is what ``default_collate`` makes of the samples — a list of fresh tensors, the same values — so the
    loss sees no difference. Used with DataLoader workers for a :func:`plain_tensors` dataset (without workers
    :class:`TensorRows` cuts it in the process)."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.tensor(indices, dtype=torch.long)
        return [t.index_select(0, index) for t in self.tensors]


def plain_tensors(dataset: Dataset, collate: Callable[[list[Any]], Any] | None) -> TypeGuard[TensorDataset]:
    """Is ``dataset`` exactly a ``TensorDataset`` batched by ``default_collate`` (``collate`` None or it)? A subclass
    may override ``__getitem__``, and another collate may expect samples."""
    return type(dataset) is TensorDataset and (collate is None or collate is default_collate)


def collated(batch: Any) -> Any:
    """The collate of :class:`TensorBatches`: its fetch already returns the batch."""
    return batch


class DatasetWrittenError(RuntimeError):
    """The loss or the model wrote into a micro-batch that is a view of an in-memory ``TensorDataset``
    (:class:`TensorRows`): the dataset itself changed."""


class TensorRows:
    """This rank's micro-batches of a ``TensorDataset``, cut in the training process (no DataLoader): what
    ``data.num_workers=0`` gets for a plain ``TensorDataset`` without a collate (:func:`micro_batches`).

    Each micro-batch is a list with one tensor per dataset tensor, the rows the order gives it, in its order:
    the batch :class:`TensorBatches` (and ``default_collate``) make. An unshuffled order (``data.shuffle=false``)
    gives each piece consecutive rows, handed out as a view of them, no copy, as a hand-written loop slices its
    tensors (a pinned dataset of a CUDA run reaches the device with one asynchronous copy and nothing else); a
    shuffled order gathers them (one ``index_select`` per tensor; on a CUDA run straight into pinned memory: one
    copy, where the DataLoader makes two, the gather, then ``pin_memory``).

    A view shares the dataset's memory, so a loss or model that wrote into its batch in place (``x.mul_``,
    ``y[mask] = -100``) would change the dataset for every later epoch, where a DataLoader's fresh batch would
    not. Every write bumps the tensor's version counter, which a view shares with the dataset's tensor: each
    fetch checks that the counters of the tensors a view was handed out of are where they were, and stops the
    run with :class:`DatasetWrittenError` at the next micro-batch after such a write
    (``tests/test_global_batch_order.py``).
    Copying every micro-batch instead is a copy of every input per micro-batch that a hand-written loop, which
    slices its tensors, does not make. Two kinds of tensor are still copied:
    an unpinned host tensor of a CUDA run (into pinned memory: the move is then asynchronous) and an inference
    tensor (made under ``torch.inference_mode``) on the training device, whose views could neither be watched (it
    keeps no version counter) nor saved for the backward.
    """

    def __init__(self, dataset: TensorDataset, sampler: OrderSampler, *, device: torch.device) -> None:
        self.tensors, self.sampler, self.pin_memory = dataset.tensors, sampler, device.type == "cuda"
        self.kinds = [(t, self._how(t, device)) for t in self.tensors]
        """Each tensor and how its consecutive rows are handed out: ``view``, ``pinned`` (a copy in pinned memory) or
        ``copy`` (a ``clone``)."""

    def _how(self, t: torch.Tensor, device: torch.device) -> str:
        if self.pin_memory and t.device.type == "cpu" and not t.is_pinned():
            return "pinned"
        if t.is_inference() and t.device == device:
            return "copy"
        return "view"

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        if self.sampler.order.shuffle:
            for piece in self.sampler.pieces():
                yield [self._gather(t, piece) for t in self.tensors]
            return
        # In order, every piece is a range of rows (0, 1, 2, ...): cut by arithmetic, no tensor per micro-batch.
        watched = [
            t for t, how in self.kinds if how == "view" and not t.is_inference()
        ]  # moved copies: unwatched
        for first, n in self.sampler.ranges():
            versions = [t._version for t in watched]
            yield [
                t[first : first + n] if how == "view" else self._copy(t[first : first + n], how)
                for t, how in self.kinds
            ]
            if [t._version for t in watched] != versions:
                raise DatasetWrittenError(self._written(first, n))

    @staticmethod
    def _copy(rows: torch.Tensor, how: str) -> torch.Tensor:
        if how == "pinned":
            return torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True).copy_(rows)
        return rows.clone()

    def _written(self, first: int, n: int) -> str:
        return (
            f"the in-memory TensorDataset changed in place while its rows {first}..{first + n - 1} were a "
            "micro-batch in training: the loss or the model wrote into its batch (x.mul_(...), y[mask] = ...). "
            "distaccum hands the rows of a TensorDataset out as views of it, as a hand-written loop slices its "
            "tensors, so the write changed the dataset itself and every later epoch would train on the changed "
            "rows. Copy what you modify (x = x.clone() before writing into it), or train with data.shuffle=true "
            "(shuffled rows are gathered into fresh tensors)"
        )

    def _gather(self, t: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
        # A dataset on the GPU: no wait for the copy of the index.
        index = piece.to(t.device, non_blocking=True)
        if self.pin_memory and t.device.type == "cpu":
            out = torch.empty((len(piece), *t.shape[1:]), dtype=t.dtype, pin_memory=True)
            return torch.index_select(t, 0, index, out=out)
        return t.index_select(0, index)


def micro_batches(
    dataset: Dataset,
    collate: Callable[[list[Any]], Any] | None,
    sampler: OrderSampler,
    *,
    device: torch.device,
    num_workers: int = 0,
    prefetch_factor: int = 2,
) -> Iterator[Any]:
    """The collated micro-batches ``sampler`` walks, for training on ``device``: a :func:`plain_tensors` dataset
    without workers through :class:`TensorRows`, anything else through :func:`build_loader`'s DataLoader (pinned
    on CUDA)."""
    if plain_tensors(dataset, collate) and num_workers == 0:
        return iter(TensorRows(dataset, sampler, device=device))
    pin = device.type == "cuda"
    loader = build_loader(
        dataset, collate, sampler, num_workers=num_workers, prefetch_factor=prefetch_factor, pin_memory=pin
    )
    return iter(loader)


def build_loader(
    dataset: Dataset,
    collate: Callable[[list[Any]], Any] | None,
    sampler: OrderSampler,
    *,
    num_workers: int = 0,
    prefetch_factor: int = 2,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader over the micro-batches ``sampler`` walks (a :func:`plain_tensors` dataset is fetched a
    micro-batch at a time: :class:`TensorBatches`)."""
    if plain_tensors(dataset, collate):
        dataset, collate = TensorBatches(dataset), collated
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate or default_collate,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
        worker_init_fn=ignore_stop_signals if num_workers > 0 else None,
    )


@dataclass
class MicroBatch:
    """One collated micro-batch of this rank."""

    batch: Any
    """On the training device."""
    samples: int
    """Real samples in it; 0 for the stand-in of an empty piece (trained with weight 0)."""


@dataclass
class WindowBatches:
    """One optimizer step's window, as this rank sees it."""

    step: int
    """0-based optimizer step."""
    epoch: int
    samples: int
    """Samples of the window over all ranks."""
    partial: bool
    """Fewer samples than the global batch (the last window of an epoch)."""
    micro: Iterator[MicroBatch]
    """This rank's K micro-batches, collated and moved to the device one at a time as the loop asks for them."""
    split: Split
    """The step's split: K micro-batches of this size on every rank (a growing batch changes it between steps)."""


class WindowSource(Protocol):
    """Where the loop's windows come from; its position is part of every checkpoint."""

    next_step: int
    """The 0-based optimizer step :meth:`window` serves next."""

    def window(self) -> WindowBatches:
        """The window at ``next_step`` (the loop calls :meth:`advance` once it is stepped)."""
        ...

    def advance(self) -> None:
        """Move to the next window."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Position and identity, enough to resume at the exact next sample."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; refuses a state from a different data order."""
        ...


class OrderPosition:
    """A window source positioned by a :class:`GlobalBatchOrder` (``order``): its ``next_step`` is the order's."""

    order: GlobalBatchOrder

    @property
    def next_step(self) -> int:
        return self.order.next_step

    @next_step.setter
    def next_step(self, step: int) -> None:
        self.order.next_step = step


class OrderSource(OrderPosition):
    """A map-style dataset served window by window through the global-batch order (:func:`micro_batches`: a
    DataLoader, or :class:`TensorRows` for an in-memory ``TensorDataset``) for training on ``device``: each
    micro-batch is moved there (floating tensors cast to ``float_dtype`` when given) as it is served."""

    def __init__(
        self,
        dataset: Dataset,
        collate: Callable[[list[Any]], Any] | None,
        order: GlobalBatchOrder,
        split: Split,
        rank: int,
        stop: int,
        *,
        device: torch.device | None = None,
        num_workers: int = 0,
        prefetch_factor: int = 2,
        float_dtype: torch.dtype | None = None,
    ) -> None:
        self.dataset, self.collate, self.order = dataset, collate, order
        self.split, self.rank, self.stop = split, rank, stop
        self.float_dtype = float_dtype
        self.loader_options: dict[str, Any] = {
            "device": device if device is not None else torch.device("cpu"),
            "num_workers": num_workers,
            "prefetch_factor": prefetch_factor,
        }
        """The keyword arguments this source was made with (a copy of it is ``OrderSource(..., **loader_options)``)."""
        self._batches: Iterator[Any] | None = None
        self._at = -1  # the step the DataLoader iterator is positioned at
        self._version = 0  # the batch growth's version the iterator was cut for
        self._served: int | None = None  # the step window() last served, until advance()

    @property
    def place(self) -> tuple[int, int]:
        """(world, rank) of the split this source cuts: its micro-batch m is piece m x world + rank of the window."""
        return self.split.world_size, self.rank

    def window(self) -> WindowBatches:
        step = self.order.next_step
        version = self.order.growth.version if self.order.growth is not None else 0
        retried, self._served = self._served == step, step  # a window served again before advance(): a redo
        if self._batches is None or self._at != step or self._version != version or retried:
            # first window, the position moved (resume), the adaptive batch changed what was prefetched, or a retry
            self._version = version
            sampler = OrderSampler(self.order, self.split, self.rank, step, self.stop)
            self._batches = micro_batches(self.dataset, self.collate, sampler, **self.loader_options)
            self._at = step
        epoch, size, sizes = self.order.rank_sizes(
            step, self.split, self.rank
        )  # no tensors: the pieces are cut
        batches = self._batches  # by the sampler (a DataLoader) or the in-process fetch (TensorRows)
        device, float_dtype = self.loader_options["device"], self.float_dtype

        def micro() -> Iterator[MicroBatch]:
            for n in sizes:
                yield MicroBatch(to_device(next(batches), device, float_dtype), n)

        split = self.order.split_at(step, self.split)
        return WindowBatches(step, epoch, size, size < self.order.batch(step), micro(), split)

    def advance(self) -> None:
        self.order.next_step += 1
        self._at += 1
        self._served = None

    def state_dict(self) -> dict[str, Any]:
        return self.order.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.order.load_state_dict(state)
        if self.order.growth is not None:  # the phases an adaptive run chose must split on this world too
            self.order.growth.check([self.split.world_size], self.split.micro_batch)


def to_device(batch: Any, device: torch.device, float_dtype: torch.dtype | None = None) -> Any:
    """Move every tensor of ``batch`` (tensors, mappings, sequences, dataclasses, nested) to ``device``;
    floating tensors also to ``float_dtype`` when given (``precision=fp64``). Other values pass through."""
    if isinstance(batch, torch.Tensor):
        moved = (
            batch if batch.device == device else batch.to(device, non_blocking=True)
        )  # no call for no move
        return moved.to(float_dtype) if float_dtype is not None and moved.is_floating_point() else moved
    # Sequences before the abstract-class check of Mapping (the in-process fetch's batch is a list).
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, float_dtype) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, float_dtype) for v in batch)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device, float_dtype) for k, v in batch.items()}
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch,
            **{
                f.name: to_device(getattr(batch, f.name), device, float_dtype)
                for f in dataclasses.fields(batch)
                if f.init
            },
        )
    return batch


def batch_size(batch: Any) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor (0 if it has none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        values: Any = batch.values()
    elif isinstance(batch, list | tuple):
        values = batch
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        return 0
    for value in values:
        n = batch_size(value)
        if n:
            return n
    return 0
