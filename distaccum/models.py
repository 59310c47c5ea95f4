"""Built-in models: ordinary ``_target_`` components like any user model (``configs/model/*.yaml``).

Each class is its own factory: ``hydra.utils.instantiate({_target_: distaccum.models.TinyGPT,
width: 64, ...})`` builds it. They need no downloads and train on two CPU cores in seconds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear(in, width) + ReLU, (depth - 1) x [Linear(width, width) + ReLU], Linear(width, out)."""

    def __init__(
        self, in_dim: int = 32, width: int = 64, depth: int = 2, out_dim: int = 8, dropout: float = 0.0
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_dim, width), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        layers.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """Pre-LayerNorm transformer block with causal self-attention."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A small causal byte-level transformer; ``blocks`` are the units FSDP shards one by one.

    Right padding never changes the logits of real tokens (attention is causal), so batches may be
    padded to any length; ``attention_mask`` is accepted and not needed.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        max_len: int = 64,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"TinyGPT width={width} must be divisible by heads={heads}")
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(max_len, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.shape[1] > self.max_len:
            raise ValueError(f"TinyGPT got sequences of {input_ids.shape[1]} tokens, max_len={self.max_len}")
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tok(input_ids) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ConvNetBN(nn.Module):
    """Conv + BatchNorm classifier: its batch statistics depend on the micro-batch (a negative control)."""

    def __init__(self, width: int = 16, depth: int = 2, classes: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for _ in range(depth):
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU()]
            channels = width
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


def block_units(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformer layers), outermost first; [] when it has none.

    The classes a Hugging Face model names in ``_no_split_modules`` (its decoder layers), else the
    children of its largest ``nn.ModuleList`` (tiny_gpt's ``blocks``). FSDP shards these units one
    by one; ``activation_checkpointing=blocks`` recomputes them. A module listed twice (shared
    weights) appears once.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    units = [m for m in model.modules() if type(m).__name__ in names] if names else []
    if not units:
        sizes = {id(m): len(m) for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)}
        lists = [m for m in model.modules() if id(m) in sizes]
        units = list(max(lists, key=lambda m: sizes[id(m)]).children()) if lists else []
    return list({id(m): m for m in units}.values())


def batch_stat_layers(module: nn.Module) -> list[str]:
    """Names of layers whose output depends on batch statistics (so on how a batch is split)."""
    # BatchNorm (and SyncBatchNorm, a subclass) normalizes over the batch; LayerNorm/GroupNorm don't.
    return [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


DROPOUT_ATTRIBUTES = ("dropout", "dropout_p", "attention_dropout", "attn_dropout")
"""Float attributes through which modules apply dropout functionally (e.g. attention)."""


def random_layers(module: nn.Module) -> list[str]:
    """Names of layers that draw random masks in training (their masks depend on the split)."""
    names = []
    for name, m in module.named_modules():
        if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0:
            names.append(name)
        elif any(isinstance(getattr(m, a, None), float) and getattr(m, a) > 0 for a in DROPOUT_ATTRIBUTES):
            names.append(name)
    return sorted(set(names))
