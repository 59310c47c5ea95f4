"""Embedded datasets and the deterministic global-batch plan.

The plan is what makes split invariance possible: optimizer step ``s`` consumes the same set of
sample indices whatever (micro_batch, accum_steps, world_size) is, and each rank's micro-batches are
fixed slices of that set. Everything ships in the package: no downloads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from importlib import resources

import torch

from distaccum.config import DataConfig, ModelConfig, Split

IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch: model inputs, targets, and how many loss items it holds."""

    inputs: torch.Tensor
    targets: torch.Tensor
    samples: int
    items: int
    """Loss items that count: non-ignored tokens (tiny_gpt) or samples (mlp, convnet_bn)."""

    def to(self, device: torch.device, dtype: torch.dtype | None = None) -> Batch:
        inputs = self.inputs.to(device)
        if dtype is not None and inputs.is_floating_point():
            inputs = inputs.to(dtype)
        targets = self.targets.to(device)
        if dtype is not None and targets.is_floating_point():
            targets = targets.to(dtype)
        return Batch(inputs, targets, self.samples, self.items)


class Dataset:
    """An in-memory dataset: ``collate(indices)`` returns one :class:`Batch`."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, counts_tokens: bool) -> None:
        self.inputs = inputs
        self.targets = targets
        self.counts_tokens = counts_tokens
        flat = targets.reshape(len(targets), -1)
        # Loss items per sample, precomputed so a window's count needs no collation.
        self.sample_items = ((flat != IGNORE_INDEX).sum(dim=1) if counts_tokens
                             else torch.ones(len(targets), dtype=torch.long))

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def count_items(self, indices: torch.Tensor) -> int:
        """Loss items of the samples at ``indices`` (what :meth:`collate` would report)."""
        return int(self.sample_items[indices].sum())

    def collate(self, indices: torch.Tensor) -> Batch:
        """Gather ``indices`` into a batch; the loss-item count is exact (ignore index excluded)."""
        if len(indices) > 1 and bool((indices[1:] - indices[:-1] == 1).all()):
            # Consecutive indices (data.shuffle=false): a view, no copy.
            start = int(indices[0])
            inputs, targets = self.inputs[start:start + len(indices)], self.targets[start:start + len(indices)]
        else:
            inputs, targets = self.inputs[indices], self.targets[indices]
        return Batch(inputs, targets, len(indices), self.count_items(indices))


def load_corpus() -> str:
    """The embedded text corpus (public-domain prose) used by tiny_gpt."""
    return resources.files("distaccum").joinpath("corpus.txt").read_text(encoding="utf-8")


def corpus_vocab() -> list[str]:
    """Character vocabulary of the corpus, sorted (index = token id)."""
    return sorted(set(load_corpus()))


def build_dataset(model: ModelConfig, data: DataConfig) -> Dataset:
    """The dataset matching ``model.name``, generated deterministically from ``data.seed``."""
    gen = torch.Generator().manual_seed(data.seed)
    n = data.num_samples
    if model.name == "mlp":
        x = torch.randn(n, model.in_dim, generator=gen)
        teacher = torch.randn(model.in_dim, model.out_dim, generator=gen) / math.sqrt(model.in_dim)
        y = torch.tanh(x @ teacher) + 0.1 * torch.randn(n, model.out_dim, generator=gen)
        return Dataset(x, y, counts_tokens=False)
    if model.name == "convnet_bn":
        x = torch.randn(n, 3, 8, 8, generator=gen)
        # Labels depend on channel means so the task is learnable.
        y = (x.mean(dim=(2, 3)) @ torch.randn(3, model.out_dim, generator=gen)).argmax(dim=1)
        return Dataset(x, y, counts_tokens=False)
    return _token_dataset(data, gen)


def _token_dataset(data: DataConfig, gen: torch.Generator) -> Dataset:
    """Variable-length character sequences from the corpus, right-padded to ``seq_max``.

    Padding sits after the real tokens and the model is causal, so padding never changes the
    loss of real tokens; labels at padded positions are IGNORE_INDEX and never counted.
    """
    text = load_corpus()
    stoi = {ch: i for i, ch in enumerate(corpus_vocab())}
    tokens = torch.tensor([stoi[ch] for ch in text], dtype=torch.long)
    n, top = data.num_samples, data.seq_max
    if len(tokens) <= top + 1:
        raise ValueError(f"data.seq_max={top} is longer than the corpus ({len(tokens)} characters)")
    lengths = torch.randint(data.seq_min, top + 1, (n,), generator=gen)
    starts = torch.randint(0, len(tokens) - top - 1, (n,), generator=gen)
    inputs = torch.zeros(n, top, dtype=torch.long)
    targets = torch.full((n, top), IGNORE_INDEX, dtype=torch.long)
    for i in range(n):
        s, length = int(starts[i]), int(lengths[i])
        inputs[i, :length] = tokens[s : s + length]
        targets[i, :length] = tokens[s + 1 : s + length + 1]
    return Dataset(inputs, targets, counts_tokens=True)


@dataclass(frozen=True)
class Window:
    """The samples of one optimizer step (one accumulation window)."""

    step: int
    """0-based optimizer step."""
    epoch: int
    indices: torch.Tensor
    """Global sample indices, in plan order; fewer than global_batch only for a partial last window."""

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


class GlobalBatchPlan:
    """Deterministic, epoch-aware walk over the dataset in windows of ``global_batch`` samples.

    Depends only on (num_samples, global_batch, seed, shuffle, drop_last), never on the split, so
    every split of the same global batch sees the same samples at the same optimizer step.
    """

    def __init__(self, num_samples: int, global_batch: int, *, seed: int, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        if global_batch > num_samples and drop_last:
            raise ValueError(f"global batch {global_batch} exceeds data.num_samples={num_samples} "
                             "with data.drop_last=true: no window would ever run")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.next_step = 0
        """Position: the 0-based optimizer step the plan hands out next (resume state)."""

    @property
    def windows_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.global_batch)
        return full if (self.drop_last or rest == 0) else full + 1

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_samples, generator=gen)

    def window(self, step: int) -> Window:
        """The window of 0-based optimizer step ``step`` (pure: does not move the position)."""
        epoch, k = divmod(step, self.windows_per_epoch)
        order = self._order(epoch)
        indices = order[k * self.global_batch : (k + 1) * self.global_batch]
        return Window(step, epoch, indices, self.global_batch)

    def __next__(self) -> Window:
        window = self.window(self.next_step)
        self.next_step += 1
        return window

    def __iter__(self) -> GlobalBatchPlan:
        return self

    def state_dict(self) -> dict[str, int]:
        """Position and identity, enough to resume at the exact next sample."""
        return {"next_step": self.next_step, "global_batch": self.global_batch, "seed": self.seed,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume; refuses a state from a plan with a different global batch, seed or dataset."""
        for key in ("global_batch", "seed", "num_samples"):
            if state[key] != getattr(self, key):
                raise ValueError(f"cannot resume: plan {key}={state[key]} in the checkpoint, "
                                 f"{getattr(self, key)} now")
        self.next_step = int(state["next_step"])
