"""Hand-written baseline training loops: what a user writes without distaccum.

Every variant trains the same MLP (:class:`ModelShape`) on the same seeded synthetic data with
plain SGD, K micro-batches per optimizer step, and times each optimizer step:

- ``ddp_every_micro`` (a): DDP, gradients all-reduced after every micro-batch.
- ``ddp_no_sync`` (b): DDP with ``no_sync()`` on micro-batches 1..K-1: one all-reduce per step.
- ``accelerate`` (c): Accelerate's ``accumulate()``.
- ``compute_floor`` (e): no DDP wrapper and no process group: the arithmetic alone. It still runs
  on every rank of the launch so that the ranks compete for the CPU exactly as in (a)-(d).

One rank runs as ``python -m benchmarks.baselines VARIANT SPEC_JSON OUT_JSON`` under torchrun-style
environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); ``benchmarks.run`` starts them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The benchmark MLP; identical to distaccum's ``model=mlp`` with the same four numbers."""

    in_dim: int
    """Input features."""
    width: int
    """Hidden units of every hidden layer."""
    depth: int
    """Hidden layers: Linear(in_dim, width) + ReLU, then depth-1 x Linear(width, width) + ReLU."""
    out_dim: int
    """Outputs of the final Linear(width, out_dim)."""

    def __post_init__(self) -> None:
        for name in ("in_dim", "width", "depth", "out_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be > 0, got {getattr(self, name)}")

    def build(self) -> nn.Sequential:
        """A freshly initialized model (seed the global RNG first for identical weights)."""
        layers: list[nn.Module] = [nn.Linear(self.in_dim, self.width), nn.ReLU()]
        for _ in range(self.depth - 1):
            layers += [nn.Linear(self.width, self.width), nn.ReLU()]
        layers.append(nn.Linear(self.width, self.out_dim))
        return nn.Sequential(*layers)

    def num_params(self) -> int:
        """Parameter count (weights and biases) without building the model."""
        hidden = (self.in_dim + 1) * self.width + (self.depth - 1) * (self.width + 1) * self.width
        return hidden + (self.width + 1) * self.out_dim

    def distaccum_overrides(self) -> list[str]:
        """The Hydra overrides that make ``distaccum train`` build this exact model."""
        return [
            "model=mlp",
            f"data.dataset.in_dim={self.in_dim}",
            f"model.width={self.width}",
            f"model.depth={self.depth}",
            f"data.dataset.out_dim={self.out_dim}",
        ]


@dataclass(frozen=True, kw_only=True)
class BenchSpec:
    """One measurement: a model, a split and how many optimizer steps to time."""

    shape: ModelShape
    """The MLP every variant trains."""
    micro_batch: int
    """Samples per micro-batch per rank."""
    accum_steps: int
    """Micro-batches per optimizer step (K)."""
    steps: int
    """Timed optimizer steps."""
    warmup: int
    """Untimed optimizer steps before them (allocation, DDP bucket rebuild)."""
    lr: float = 1e-3
    """SGD learning rate (no momentum, no weight decay, no clipping)."""
    seed: int = 0
    """Seed for the initial weights (same on every rank) and the data (offset by rank)."""

    def __post_init__(self) -> None:
        for name in ("micro_batch", "accum_steps", "steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"BenchSpec.{name} must be > 0, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"BenchSpec.warmup must be >= 0, got {self.warmup}")

    def to_json(self) -> str:
        """Serialize for a worker's command line."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchSpec:
        """Inverse of :meth:`to_json`."""
        values = json.loads(text)
        return cls(**{**values, "shape": ModelShape(**values["shape"])})


def pool_micro_batches(accum_steps: int) -> int:
    """Micro-batches of data held per rank: the same for every K up to 16, a multiple of K.

    A pool that grew with K would make peak memory grow with K for a reason that has nothing
    to do with accumulation; distaccum is given a dataset of the same size.
    """
    return math.lcm(16, accum_steps)


def make_windows(spec: BenchSpec, rank: int) -> list[list[Batch]]:
    """This rank's synthetic data, cut into windows of K micro-batches (one per optimizer step).

    Generated once before timing: producing data inside the timed region would measure the
    random number generator, not the training step.
    """
    gen = torch.Generator().manual_seed(spec.seed * 1000 + rank)
    shape, k = spec.shape, spec.accum_steps
    pool = [
        (
            torch.randn(spec.micro_batch, shape.in_dim, generator=gen),
            torch.randn(spec.micro_batch, shape.out_dim, generator=gen),
        )
        for _ in range(pool_micro_batches(k))
    ]
    return [pool[i : i + k] for i in range(0, len(pool), k)]


def _build_model(spec: BenchSpec) -> nn.Sequential:
    torch.manual_seed(spec.seed)  # identical initial weights on every rank
    return spec.shape.build()


def _timed_steps(
    spec: BenchSpec, windows: list[list[Batch]], one_step: Callable[[list[Batch]], None]
) -> list[float]:
    """Run warm-up then timed optimizer steps; return the timed wall times in seconds.

    On CPU every op is synchronous and DDP waits for its all-reduce at the end of backward, so
    perf_counter around the step covers compute and communication without an explicit sync.
    """
    times = []
    for step in range(spec.warmup + spec.steps):
        batches = windows[step % len(windows)]
        start = time.perf_counter()
        one_step(batches)
        times.append(time.perf_counter() - start)
    return times[spec.warmup :]


@contextlib.contextmanager
def _process_group() -> Iterator[None]:
    dist.init_process_group("gloo")
    try:
        yield
    finally:
        # A barrier before destroy avoids gloo threads racing interpreter shutdown.
        dist.barrier()
        dist.destroy_process_group()


def train_ddp_every_micro(spec: BenchSpec, windows: list[list[Batch]]) -> list[float]:
    """(a) DDP that all-reduces the gradients of every micro-batch."""
    with _process_group():
        model = DDP(_build_model(spec))
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)

        def one_step(batches: list[Batch]) -> None:
            for x, y in batches:
                loss = F.mse_loss(model(x), y) / len(batches)
                loss.backward()  # DDP all-reduces this micro-batch's gradients here
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return _timed_steps(spec, windows, one_step)


def train_ddp_no_sync(spec: BenchSpec, windows: list[list[Batch]]) -> list[float]:
    """(b) DDP that skips the all-reduce on micro-batches 1..K-1 with ``no_sync()``."""
    with _process_group():
        model = DDP(_build_model(spec))
        optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)

        def one_step(batches: list[Batch]) -> None:
            for i, (x, y) in enumerate(batches):
                last = i == len(batches) - 1
                # Gradients accumulate locally; only the last backward all-reduces the sum.
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.mse_loss(model(x), y) / len(batches)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return _timed_steps(spec, windows, one_step)


def train_accelerate(spec: BenchSpec, windows: list[list[Batch]]) -> list[float]:
    """(c) Accelerate's ``accumulate()``, the loop from its gradient-accumulation guide."""
    from accelerate import Accelerator  # optional dependency, only this variant needs it

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=spec.accum_steps)
    model = _build_model(spec)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=spec.lr))

    def one_step(batches: list[Batch]) -> None:
        for x, y in batches:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(x), y)
                accelerator.backward(loss)  # divides by K itself; syncs only on the K-th call
                optimizer.step()  # a no-op until the K-th micro-batch
                optimizer.zero_grad()

    times = _timed_steps(spec, windows, one_step)
    accelerator.wait_for_everyone()
    dist.destroy_process_group()
    return times


def train_compute_floor(spec: BenchSpec, windows: list[list[Batch]]) -> list[float]:
    """(e) The same loop without DDP or a process group: no communication at all."""
    model = _build_model(spec)
    optimizer = torch.optim.SGD(model.parameters(), lr=spec.lr)

    def one_step(batches: list[Batch]) -> None:
        for x, y in batches:
            loss = F.mse_loss(model(x), y) / len(batches)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed_steps(spec, windows, one_step)


VARIANTS: dict[str, Callable[[BenchSpec, list[list[Batch]]], list[float]]] = {
    "ddp_every_micro": train_ddp_every_micro,
    "ddp_no_sync": train_ddp_no_sync,
    "accelerate": train_accelerate,
    "compute_floor": train_compute_floor,
}


def run_worker(variant: str, spec: BenchSpec) -> dict[str, Any]:
    """Train ``variant`` on this rank and return its measurement record."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
    rank = int(os.environ.get("RANK", "0"))
    step_s = VARIANTS[variant](spec, make_windows(spec, rank))
    # Peak memory is read by the launcher (os.wait4), the same way for every variant.
    return {"variant": variant, "rank": rank, "step_s": step_s}


def main(argv: list[str] | None = None) -> None:
    """Worker entry: ``VARIANT SPEC_JSON OUT_JSON``; writes the record to OUT_JSON."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        raise SystemExit("usage: python -m benchmarks.baselines VARIANT SPEC_JSON OUT_JSON")
    variant, spec_json, out_path = args
    record = run_worker(variant, BenchSpec.from_json(spec_json))
    Path(out_path).write_text(json.dumps(record))
    # gloo's threads occasionally abort interpreter teardown ("terminate called without an active
    # exception", seen once in ~40 launches here); the record is on disk, so skip the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
