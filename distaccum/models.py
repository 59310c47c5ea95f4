"""Embedded models and their summed losses.

Every loss here is a SUM over loss items (never a mean): the training loop divides by the global
item count of the whole window, which is the only normalization that makes accumulated gradients
equal to full-batch gradients when micro-batches hold different numbers of items.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from distaccum.config import DataConfig, ModelConfig
from distaccum.data import IGNORE_INDEX, corpus_vocab

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class MLP(nn.Module):
    """Linear(in, width) + ReLU, (depth - 1) x [Linear(width, width) + ReLU], Linear(width, out)."""

    def __init__(self, in_dim: int, width: int, depth: int, out_dim: int, dropout: float = 0.0) -> None:
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
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """A small causal character-level transformer. ``blocks`` is the unit FSDP shards per block."""

    def __init__(self, vocab: int, block_size: int, width: int, depth: int, heads: int,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block_size, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class ConvNetBN(nn.Module):
    """Conv + BatchNorm classifier: its batch statistics depend on the micro-batch (a negative control)."""

    def __init__(self, width: int, depth: int, classes: int) -> None:
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


def mse_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Squared error summed over output features, then over samples (one item per sample)."""
    return F.mse_loss(out, target, reduction="sum")


def ce_sum(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over samples."""
    return F.cross_entropy(out, target, reduction="sum")


def token_ce_sum(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy summed over non-ignored tokens."""
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.dtype in (torch.float16, torch.bfloat16):  # autocast logits: take the softmax in fp32
        flat = flat.float()
    return F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")


def build_model(model: ModelConfig, data: DataConfig) -> tuple[nn.Module, LossFn]:
    """The model named by ``model.name`` (seed the RNG first for reproducible weights) and its loss."""
    if model.name == "mlp":
        return MLP(model.in_dim, model.width, model.depth, model.out_dim, model.dropout), mse_sum
    if model.name == "convnet_bn":
        return ConvNetBN(model.width, model.depth, model.out_dim), ce_sum
    vocab = len(corpus_vocab())
    net = TinyGPT(vocab, data.seq_max, model.width, model.depth, model.heads, model.dropout)
    return net, token_ce_sum


def batch_stat_layers(module: nn.Module) -> list[str]:
    """Names of layers whose output depends on batch statistics (so on how a batch is split)."""
    # BatchNorm (and SyncBatchNorm, a subclass) normalizes over the batch; LayerNorm/GroupNorm don't.
    return [name for name, m in module.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def random_layers(module: nn.Module) -> list[str]:
    """Names of active dropout layers (their masks depend on how a batch is split)."""
    names = [name for name, m in module.named_modules()
             if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    names += [name for name, m in module.named_modules() if isinstance(m, Block) and m.dropout > 0]
    return sorted(set(names))
