"""What the benchmark trains: the cases, one launch's specification, the data and the loss.

Every variant of a measurement trains distaccum's own MLP (:class:`distaccum.models.MLP`), built
from the same seed, on the same samples in the same order, with the same SGD: the hand-written
loops take their micro-batches from the same global-batch order (in order) that distaccum's
:class:`~distaccum.trainer.Trainer` walks, as views of the same tensors the Trainer is given, so
both do the same arithmetic (checked at the end of every launch).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from distaccum.config import Split
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.models import MLP

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """distaccum's ``MLP``: Linear(in_dim, width) + ReLU, (depth-1) x Linear(width, width) + ReLU,
    Linear(width, out_dim)."""

    in_dim: int
    width: int
    depth: int
    out_dim: int

    def build(self) -> nn.Module:
        """A freshly initialized model (seed the global RNG first for identical weights)."""
        return MLP(in_dim=self.in_dim, width=self.width, depth=self.depth, out_dim=self.out_dim)

    def num_params(self) -> int:
        """Parameter count (weights and biases) without building the model."""
        hidden = (self.in_dim + 1) * self.width + (self.depth - 1) * (self.width + 1) * self.width
        return hidden + (self.width + 1) * self.out_dim


@dataclass(frozen=True, kw_only=True)
class Case:
    """A model and micro-batch, measured at several accumulation depths K."""

    name: str
    about: str
    shape: ModelShape
    micro_batch: int
    ks: tuple[int, ...] = (1, 4, 16)
    """K values of the timing table."""
    sweep_ks: tuple[int, ...] = (1, 16)
    """K values of the memory sweep (fresh processes each): the smallest and the largest."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    """One launch: a case at one K, everything every rank needs to build identical variants."""

    case: str
    shape: ModelShape
    micro_batch: int
    accum_steps: int
    steps: int
    """Timed optimizer steps per variant per round (one block)."""
    warmup: int = 2
    """Untimed optimizer steps per variant before the first round (allocation, DDP's bucket rebuild after its
    first iteration, the optimizer's first step, compilation)."""
    rounds: int = 1
    """Rounds to run; with ``budget_s``, the most (the Trainer's ``max_steps`` is sized for them)."""
    budget_s: float = 0.0
    """When positive: stop after the first whole cycle of rounds (:func:`benchmarks.workers.cycle_length`) that
    ends with ``budget_s`` seconds of rounds behind it, so every split gets the same machine time whatever its
    step. Stopping depends on the clock only, never on the times measured."""
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    """cpu (gloo) or cuda (NCCL)."""
    precision: str = "fp32"
    """fp32, or bf16: every variant's forward under bf16 autocast (distaccum: ``precision=bf16``)."""
    variants: tuple[str, ...] = ()
    """The variants, in their round-0 order (a memory launch: exactly one)."""

    @property
    def total_steps(self) -> int:
        """Optimizer steps every variant runs in the launch."""
        return self.warmup + self.rounds * self.steps

    def split(self, world_size: int) -> Split:
        """The split every variant uses."""
        return Split(self.micro_batch, self.accum_steps, world_size)

    def to_json(self) -> str:
        """For a worker's command line."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Spec:
        """Inverse of :meth:`to_json`."""
        values: dict[str, Any] = json.loads(text)
        return cls(
            **{**values, "shape": ModelShape(**values["shape"]), "variants": tuple(values["variants"])}
        )


def launch_spec(case: Case, k: int, *, steps: int, **extra: Any) -> Spec:
    """The spec of ``case`` at ``k`` with blocks of ``steps`` optimizer steps."""
    if steps < 1:
        raise ValueError(f"a block needs at least one optimizer step, got {steps}")
    return Spec(
        case=case.name, shape=case.shape, micro_batch=case.micro_batch, accum_steps=k, steps=steps, **extra
    )


def pool_micro_batches(accum_steps: int) -> int:
    """Micro-batches of data per rank: 16 for every K up to 16 (a multiple of K beyond), so the
    data's memory does not grow with K."""
    return math.lcm(16, accum_steps)


def rows(x: torch.Tensor, y: torch.Tensor, indices: list[int]) -> Batch:
    """The samples ``indices`` of ``(x, y)``: views when they are consecutive (the in-order walk), else a gather,
    as the Trainer cuts a ``TensorDataset``."""
    first, last = indices[0], indices[-1]
    if indices == list(range(first, last + 1)):
        return x[first : last + 1], y[first : last + 1]
    index = torch.tensor(indices)
    return x[index], y[index]


class BenchData:
    """The seeded samples of a launch (identical on every rank) and the in-order plan over them."""

    def __init__(self, spec: Spec, world_size: int) -> None:
        self.split = spec.split(world_size)
        size = pool_micro_batches(spec.accum_steps) * spec.micro_batch * world_size
        gen = torch.Generator().manual_seed(spec.seed + 1)
        self.x = torch.randn(size, spec.shape.in_dim, generator=gen)
        self.y = torch.randn(size, spec.shape.out_dim, generator=gen)
        if spec.device == "cuda":  # every variant copies its micro-batches host -> GPU from pinned memory
            self.x, self.y = self.x.pin_memory(), self.y.pin_memory()
        self.seed = spec.seed

    def order(self) -> GlobalBatchOrder:
        """The in-order walk distaccum's Trainer takes with ``data.shuffle=false``."""
        return GlobalBatchOrder(len(self.x), self.split.global_batch, seed=self.seed, shuffle=False)

    def windows(self, rank: int) -> list[list[Batch]]:
        """This rank's micro-batches of every window of one epoch, exactly as the Trainer cuts them;
        optimizer step s trains on window ``s % len(windows)``."""
        order = self.order()
        return [
            [
                rows(self.x, self.y, piece.tolist())
                for piece in order.window(s).rank_micro_batches(self.split, rank)
            ]
            for s in range(order.windows_per_epoch)
        ]


def loss_sum(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, int]:
    """distaccum's loss contract: the squared error summed over samples and averaged over the
    output features, and the sample count. Divided by the window's global sample count it is
    exactly the hand-written loops' ``mse_loss(...) / K`` averaged over ranks."""
    x, y = batch
    return F.mse_loss(model(x), y, reduction="sum") / y.shape[1], int(y.shape[0])


def sgd(lr: float) -> Any:
    """The optimizer factory every variant uses: plain SGD (no momentum, decay or schedule)."""
    return lambda params: torch.optim.SGD(params, lr=lr)


FULL_CASES = (
    Case(
        name="27.3M_micro4",
        about="27.3M-parameter MLP, micro-batch 4: the gradient all-reduce rivals the compute",
        shape=ModelShape(in_dim=1024, width=2048, depth=7, out_dim=16),
        micro_batch=4,
    ),
    Case(
        name="0.9M_micro256",
        about="0.9M-parameter MLP, micro-batch 256: compute dominates",
        shape=ModelShape(in_dim=768, width=512, depth=3, out_dim=16),
        micro_batch=256,
    ),
)
"""What ``make bench`` measures (CPU)."""
GPU_CASES = (
    Case(
        name="210M_micro1024",
        about="210M-parameter MLP, micro-batch 1024: sized for one large GPU (bf16), "
        "where the two cases above are bound by kernel launches",
        shape=ModelShape(in_dim=1024, width=8192, depth=4, out_dim=16),
        micro_batch=1024,
    ),
)
"""Too large for a CPU run: measured when named with ``--cases`` (``benchmarks/gpu_check.sh``)."""
SMOKE_CASES = (
    Case(
        name="smoke",
        about="tiny MLP: the CI run (structure, not timings)",
        shape=ModelShape(in_dim=16, width=32, depth=2, out_dim=4),
        micro_batch=2,
        ks=(1, 2),
        sweep_ks=(1, 2),
    ),
)
