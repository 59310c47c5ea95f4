"""Your own model, data and loss with distaccum's Trainer, inside your own torchrun script.

torchrun --nproc_per_node=2 examples/own_loop.py --micro-batch 4 --global-batch 32 --steps 20
distaccum verify --script examples/own_loop.py -- --precision fp64 --steps 5   # check it
"""

import argparse

import torch
from torch import nn
from torch.utils.data import Dataset

from distaccum import Trainer


class Sentences(Dataset):
    """Variable-length token sequences: micro-batches hold different numbers of loss items."""

    def __init__(self, size: int = 256, vocab: int = 50) -> None:
        gen = torch.Generator().manual_seed(0)
        self.seqs = [
            torch.randint(1, vocab, (int(n),), generator=gen)
            for n in torch.randint(4, 17, (size,), generator=gen)
        ]

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.seqs[i]


def collate(seqs: list[torch.Tensor]) -> torch.Tensor:
    return nn.utils.rnn.pad_sequence(seqs, batch_first=True)  # 0 = padding


def make_model(vocab: int = 50, width: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Embedding(vocab, width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, vocab)
    )


def loss_sum(model: nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy SUMMED over real tokens, and their count (never a mean)."""
    logits, targets = model(tokens[:, :-1]), tokens[:, 1:]
    loss = nn.functional.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=0, reduction="sum"
    )
    return loss, (targets != 0).sum()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "fp64", "bf16"])
    ap.add_argument("--run-dir", default="runs/own_loop")
    args = ap.parse_args()
    config = {
        "accum": {"micro_batch": args.micro_batch, "global_batch": args.global_batch},
        "trainer": {"max_steps": args.steps},
        "precision": args.precision,
        "run_dir": args.run_dir,
        "optim": {"lr": 1e-2},
        "log": {"console": "bar"},
    }
    summary = Trainer(config, model=make_model, dataset=Sentences(), collate=collate, loss=loss_sum).fit()
