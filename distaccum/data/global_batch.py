"""The deterministic global-batch order: which samples each optimizer step, rank and micro-batch takes.

The order is what makes split invariance possible: optimizer step ``s`` consumes the same set of
sample indices whatever (micro_batch, accum_steps, world_size) is, and each rank's micro-batches are
fixed slices of that set. It depends only on (num_samples, global_batch, seed, shuffle, drop_last).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distaccum.batching.growth import BatchGrowth, phase_split
from distaccum.config import Split


@dataclass(frozen=True)
class Window:
    """The samples of one optimizer step (one accumulation window)."""

    step: int
    """0-based optimizer step."""
    epoch: int
    indices: torch.Tensor
    """Global sample indices, in order; fewer than global_batch only for a partial last window."""
    global_batch: int

    @property
    def partial(self) -> bool:
        """True for a last window holding fewer than global_batch samples."""
        return len(self.indices) < self.global_batch

    def rank_micro_batches(self, split: Split, rank: int) -> list[torch.Tensor]:
        """This rank's ``accum_steps`` micro-batch index slices.

        The window is cut into accum_steps * world_size pieces laid out [micro][rank]: micro-batch m
        of rank r is piece m * world + r. A full window gives every piece micro_batch samples; a
        partial one spreads what it has as evenly as possible (sizes differ by at most one), so a
        piece may be empty. The loop weights every piece by its real item count, never by K.
        """
        pieces = torch.tensor_split(self.indices, split.accum_steps * split.world_size)
        return [pieces[m * split.world_size + rank] for m in range(split.accum_steps)]


class GlobalBatchOrder:
    """Deterministic, epoch-aware walk over the dataset in windows of ``global_batch`` samples.

    Depends only on (num_samples, global_batch or its growth, seed, shuffle, drop_last), never on the split, so
    every split of the same global batch sees the same samples at the same optimizer step. With a ``growth``
    (:class:`~distaccum.batching.growth.BatchGrowth`: a ramp, the adaptive batch) step s takes the next G_s
    samples of the same epoch order: the stream of samples is the unramped run's, only cut into windows of other
    sizes (an epoch ends where its samples do; with ``drop_last`` a window that would cross the end is dropped).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
        growth: BatchGrowth | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("the dataset is empty: there is nothing to train on")
        largest = max(global_batch, growth.largest if growth is not None else 0)
        if largest > num_samples and drop_last:
            raise ValueError(
                f"the global batch ({largest} samples) is larger than the dataset "
                f"({num_samples} samples) with data.drop_last=true: no window would ever run. "
                "Lower accum.global_batch (or micro_batch x steps x world) or set data.drop_last=false"
            )
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.growth = growth
        """The batch growth (a ramp, the adaptive rule's phases so far); None: ``global_batch`` every step."""
        self._walk = (0, 0, 0)
        """(step, epoch, first position) of the last step :meth:`_place` walked to (a growing batch's order)."""
        self.next_step = 0
        """Position: the 0-based optimizer step the order hands out next (resume state)."""
        self._epoch_order: tuple[int, torch.Tensor] | None = None
        """The last epoch's order, kept: every window of an epoch slices it, and drawing a permutation of a
        million samples takes tens of milliseconds, while the sampler and the loop each ask for every window."""
        self._pieces: dict[tuple[int, int, int, int], tuple[Window, list[torch.Tensor]]] = {}
        """The last few :meth:`rank_pieces` (see there)."""

    @property
    def windows_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full if (self.drop_last or rest == 0) else full + 1

    def _order(self, epoch: int) -> torch.Tensor:
        if self._epoch_order is not None and self._epoch_order[0] == epoch:
            return self._epoch_order[1]
        if not self.shuffle:
            order = torch.arange(self.num_samples)
        else:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples, generator=gen)
        self._epoch_order = (epoch, order)
        return order

    def batch(self, step: int) -> int:
        """The global batch of 0-based optimizer step ``step``."""
        return self.global_batch if self.growth is None else self.growth.global_batch(step)

    def _place(self, step: int) -> tuple[int, int, int]:
        """(epoch, the window's first position in the epoch's order, its global batch) of ``step``. A constant batch
        by arithmetic; a growing batch by walking the windows from the last step asked (from 0 when asked backwards)."""
        if self.growth is None:
            epoch, k = divmod(step, self.windows_per_epoch)
            return epoch, k * self.global_batch, self.global_batch
        at, epoch, start = self._walk if self._walk[0] <= step else (0, 0, 0)
        batch = self.growth.global_batch(at)
        while True:
            if start >= self.num_samples or (self.drop_last and start + batch > self.num_samples):
                epoch, start = epoch + 1, 0  # this epoch's samples are spent (or the rest is dropped)
            if at == step:
                break
            start, at = start + batch, at + 1
            batch = self.growth.global_batch(at)
        self._walk = (at, epoch, start)
        return epoch, start, batch

    def window(self, step: int) -> Window:
        """The window of 0-based optimizer step ``step`` (pure: does not move the position)."""
        epoch, start, batch = self._place(step)
        order = self._order(epoch)
        return Window(step, epoch, order[start : start + batch], batch)

    def split_at(self, step: int, split: Split) -> Split:
        """The split of ``step``: ``split`` itself, or with a growing batch its phase's (K follows the global batch)."""
        if self.growth is None:
            return split
        return phase_split(self.growth.global_batch(step), split.micro_batch, split.world_size)

    def rank_pieces(self, step: int, split: Split, rank: int) -> tuple[Window, list[torch.Tensor]]:
        """:meth:`window` of ``step`` and its :meth:`Window.rank_micro_batches` for ``rank``, kept for the last 4
        steps asked (a sampler asks once per piece it serves; the loop itself needs only :meth:`rank_sizes`)."""
        key = (step, split.accum_steps, split.world_size, rank)
        found = self._pieces.get(key)
        if found is None:
            window = self.window(step)
            found = self._pieces[key] = (window, window.rank_micro_batches(self.split_at(step, split), rank))
            if len(self._pieces) > 4:
                del self._pieces[next(iter(self._pieces))]  # the oldest
        return found

    def _cut(self, step: int, split: Split) -> tuple[int, int, int, int, int]:
        """(epoch, the window's first position in the epoch's order, its samples, and ``tensor_split``'s piece size q
        and remainder r: its first r of ``accum_steps x world`` pieces get q + 1 samples, the others q), by
        arithmetic alone: the window's size does not depend on the order."""
        epoch, start, batch = self._place(step)
        size = min(batch, self.num_samples - start)
        split = self.split_at(step, split)
        return (epoch, start, size, *divmod(size, split.accum_steps * split.world_size))

    def rank_sizes(self, step: int, split: Split, rank: int) -> tuple[int, int, list[int]]:
        """(epoch, samples in the window, this rank's micro-batch sizes) of ``step`` (:meth:`_cut`). A size of 0 is an
        empty piece (its stand-in trains with weight 0). What the loop needs of a window without cutting one
        (:meth:`rank_pieces` makes tensors: tens of microseconds per step here)."""
        epoch, _, size, q, r = self._cut(step, split)
        split = self.split_at(step, split)
        world = split.world_size
        return epoch, size, [q + (1 if m * world + rank < r else 0) for m in range(split.accum_steps)]

    def rank_ranges(self, step: int, split: Split, rank: int) -> list[tuple[int, int]]:
        """For an unshuffled order (``shuffle=False``): :meth:`rank_pieces`' micro-batches as (first sample, count), by
        arithmetic alone (the window is a range cut as :meth:`_cut` says); an empty piece is the stand-in (the
        window's first sample, once), as :meth:`OrderSampler.pieces` serves it. No tensor is made or read: the
        in-process fetch asks per micro-batch."""
        if self.shuffle:
            raise ValueError(
                "rank_ranges needs an in-order global-batch order (shuffle=False): a shuffled window is no range"
            )
        _, start, _, q, r = self._cut(step, split)
        split = self.split_at(step, split)
        out = []
        for m in range(split.accum_steps):
            j = m * split.world_size + rank
            n = q + (1 if j < r else 0)
            out.append((start + j * q + min(j, r), n) if n else (start, 1))
        return out

    def state_dict(self) -> dict[str, Any]:
        """Position and identity, enough to resume at the exact next sample (and the batch growth's phases so far)."""
        state: dict[str, Any] = {
            "next_step": self.next_step,
            "global_batch": self.global_batch,
            "seed": self.seed,
            "num_samples": self.num_samples,
        }
        if self.growth is not None:
            state["growth"] = self.growth.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume; refuses a state from an order with a different global batch, seed or dataset. A growth takes the
        checkpoint's phases (the adaptive rule's decisions; a ramp's are the same ones, the config is compared
        before any worker starts)."""
        for key in ("global_batch", "seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume: order {key}={state[key]} in the checkpoint, {getattr(self, key)} now"
                )
        if "growth" not in state and "schedule" in state:  # its name before issue 57
            state = {**state, "growth": state["schedule"]}
        if ("growth" in state) != (self.growth is not None):
            raise ValueError(
                "cannot resume: the checkpoint's run and this one differ in having a batch growth"
            )
        if self.growth is not None:
            self.growth.load_state_dict(state["growth"])
            self._walk = (0, 0, 0)
        self.next_step = int(state["next_step"])
