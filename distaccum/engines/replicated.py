"""What the replicated engines (DDP, and Accelerate, which drives DDP) share: the counting comm hook
and whole-parameter state on every rank.

Each rank holds every parameter and every (reduced) gradient, so the step, the full parameters, the
state dict and the checkpoint are the same code for both; only wrapping and sync control differ.
"""

# No ``from __future__ import annotations`` here: DDP inspects the comm hook's real annotations.

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.engines.base import EngineBase, EngineSpec, StepResult, dcp_load, dcp_save, step_plain
from distaccum.telemetry.gns import GradSquares
from distaccum.telemetry.ledger import CommLedger


@dataclass
class HookState:
    """State of the gradient comm hook: the ledger it reports to, and the noise-scale terms."""

    ledger: CommLedger
    squares: GradSquares | None = None
    """When set (``log.gns``), the bucket's squared norm before and after the reduction."""
    dtype: torch.dtype | None = None
    """The dtype :func:`compressed_allreduce_hook` reduces in (``accum.reduce_dtype``)."""


def mean_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket to the mean over ranks, counting every call and byte.

    Why the mean and not the sum: with ``accum.sync=every_micro`` the bucket holds the already
    reduced gradient of earlier micro-batches plus this rank's new contribution. The mean of
    identical values is that value, so only the new part is averaged; a sum would multiply the
    earlier part by the world size. The loop compensates the 1/world with ``grad_divisor``.
    """
    buffer = bucket.buffer()
    if state.squares is not None:  # this rank's accumulated gradient, before the reduction overwrites it
        state.squares.add_local(buffer)
    token = state.ledger.launched(buffer)
    buffer.div_(dist.get_world_size())
    future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.ledger.completed(token)
        if state.squares is not None:
            state.squares.add_reduced(fut.value()[0])
        return fut.value()[0]

    return future.then(done)


def compressed_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`mean_allreduce_hook` with the bucket all-reduced in ``state.dtype`` (bf16/fp16): half the bytes.

    The bucket is divided by the world size in its own dtype, cast (the one rounding of this rank's
    accumulated gradient), all-reduced in the low dtype and copied back into the bucket, so the
    gradients stay in the parameters' dtype between reductions. PyTorch's ``bf16_compress_hook`` does
    the same but refuses gloo; this one also counts the compressed bytes in the ledger.
    """
    buffer = bucket.buffer()
    if state.squares is not None:
        state.squares.add_local(buffer)
    assert state.dtype is not None
    compressed = buffer.div_(dist.get_world_size()).to(state.dtype)  # divide first: fp16 must not overflow
    token = state.ledger.launched(compressed)
    future = dist.all_reduce(compressed, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.ledger.completed(token)
        buffer.copy_(fut.value()[0])
        if state.squares is not None:
            state.squares.add_reduced(buffer)
        return buffer

    return future.then(done)


CommHook = Callable[[HookState, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class ReplicatedEngine(EngineBase):
    """Base of the engines that keep whole parameters on every rank behind a DDP module.

    Subclasses set ``raw`` (the plain model), ``optimizer`` and ``scaler`` in ``wrap`` and install
    :attr:`comm_hook` on their DDP module with :meth:`register_hook`.
    """

    comm_hook: ClassVar[CommHook] = staticmethod(mean_allreduce_hook)  # type: ignore[assignment]
    """The gradient comm hook installed on the DDP module: DDP takes exactly one, so anything that wants
    to see or change the reduction (the ledger, the noise scale, a test's fault) goes through it. With
    ``accum.reduce_dtype`` bf16/fp16 the engine holds :func:`compressed_allreduce_hook` instead."""
    reduce_dtypes = ("fp32", "bf16", "fp16")
    replicated_gradients = True  # every rank's .grad holds the whole all-reduced gradient
    grads_to_none: ClassVar[bool] = True
    """Drop gradients after the step (True) or zero them in place (False: they are bucket views)."""
    raw: nn.Module | None = None
    optimizer: torch.optim.Optimizer
    scaler: "torch.amp.GradScaler | None" = None
    ledger: CommLedger

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        super().__init__(spec, ledger)
        if spec.compressed_dtype is not None:  # on the instance: what register_hook installs, faults wrap
            self.comm_hook = compressed_allreduce_hook  # type: ignore[misc]

    def register_hook(self, ddp: DDP) -> None:
        """Install :attr:`comm_hook` on ``ddp``, reporting to the ledger (and the noise scale)."""
        state = HookState(self.ledger, self.grad_squares, self.spec.compressed_dtype)
        ddp.register_comm_hook(state, self.comm_hook)

    def _raw(self) -> nn.Module:
        assert self.raw is not None, "wrap() first"
        return self.raw

    def step(self, max_norm: float | None, grad_scale: torch.Tensor) -> StepResult:
        return step_plain(self.optimizer, list(self._raw().named_parameters()), max_norm, grad_scale, self.scaler,
                          grads_to_none=self.grads_to_none)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._raw().named_parameters():
            yield name, param.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self._raw().state_dict().items()}

    def unwrapped(self) -> nn.Module:
        return self._raw()

    def save_state(self, directory: Path) -> dict[str, Any]:
        dcp_save(directory, self._raw(), self.optimizer)  # replicated: written once, loadable on any world size
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        dcp_load(directory, self._raw(), self.optimizer)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
