"""Built-in datasets (map-style ``torch.utils.data.Dataset``) and the padding collate for token samples.

They are ordinary ``_target_`` components (``configs/data/*.yaml``), generated deterministically
from a seed, and ship inside the package: nothing is downloaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from importlib import resources

import torch
from torch.utils.data import Dataset

from distaccum.losses import IGNORE_INDEX


def load_corpus() -> str:
    """The embedded text corpus (public-domain prose)."""
    return resources.files("distaccum").joinpath("corpus.txt").read_text(encoding="utf-8")


def byte_tokens(text: str) -> torch.Tensor:
    """Byte-level token ids (vocabulary 256: no tokenizer files, no download)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class SyntheticRegression(Dataset):
    """``(x, y)`` pairs with ``y = tanh(x W) + noise`` (a learnable teacher): one loss item per sample."""

    def __init__(self, num_samples: int = 512, in_dim: int = 32, out_dim: int = 8, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, in_dim, generator=gen)
        teacher = torch.randn(in_dim, out_dim, generator=gen) / math.sqrt(in_dim)
        self.y = torch.tanh(self.x @ teacher) + 0.1 * torch.randn(num_samples, out_dim, generator=gen)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class SyntheticImages(Dataset):
    """3x8x8 images labelled by their channel means: a learnable task for the BatchNorm convnet."""

    def __init__(self, num_samples: int = 512, classes: int = 4, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, 3, 8, 8, generator=gen)
        self.y = (self.x.mean(dim=(2, 3)) @ torch.randn(3, classes, generator=gen)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class CorpusSequences(Dataset):
    """Variable-length byte sequences cut from the embedded corpus, for next-token prediction.

    Sample i is ``{"input_ids": t[s:s+L], "labels": t[s+1:s+L+1]}`` with L drawn from
    [seq_min, seq_max]: micro-batches hold different numbers of loss items, which is exactly what
    breaks the classic loss/K (and what distaccum's global-count normalization gets right).
    """

    def __init__(self, num_samples: int = 512, seq_min: int = 8, seq_max: int = 32, seed: int = 1234) -> None:
        if not 0 < seq_min <= seq_max:
            raise ValueError(f"CorpusSequences needs 0 < seq_min <= seq_max, got {seq_min}, {seq_max}")
        tokens = byte_tokens(load_corpus())
        if len(tokens) <= seq_max + 1:
            raise ValueError(f"seq_max={seq_max} is longer than the corpus ({len(tokens)} bytes)")
        gen = torch.Generator().manual_seed(seed)
        self.tokens = tokens
        self.lengths = torch.randint(seq_min, seq_max + 1, (num_samples,), generator=gen)
        self.starts = torch.randint(0, len(tokens) - seq_max - 1, (num_samples,), generator=gen)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        s, n = int(self.starts[i]), int(self.lengths[i])
        return {"input_ids": self.tokens[s : s + n], "labels": self.tokens[s + 1 : s + n + 1]}


def pad_collate(
    samples: Sequence[Mapping[str, torch.Tensor]],
    *,
    pad_id: int = 0,
    label_pad: int = IGNORE_INDEX,
    pad_to: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad variable-length token samples into a batch, with an ``attention_mask``.

    Inputs are padded with ``pad_id``, labels with ``label_pad`` (the loss ignores them); length is
    the longest sample, or ``pad_to`` when given (a fixed shape).
    """
    if not samples:
        raise ValueError("pad_collate got no samples")
    length = max(len(s["input_ids"]) for s in samples)
    if pad_to is not None:
        if pad_to < length:
            raise ValueError(f"pad_collate: a sample has {length} tokens, more than pad_to={pad_to}")
        length = pad_to
    batch: dict[str, torch.Tensor] = {
        "input_ids": torch.full((len(samples), length), pad_id, dtype=torch.long),
        "attention_mask": torch.zeros((len(samples), length), dtype=torch.long),
    }
    if "labels" in samples[0]:
        batch["labels"] = torch.full((len(samples), length), label_pad, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        batch["input_ids"][row, :n] = sample["input_ids"]
        batch["attention_mask"][row, :n] = 1
        if "labels" in batch:
            batch["labels"][row, : len(sample["labels"])] = sample["labels"]
    return batch
