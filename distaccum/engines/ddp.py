"""DDP engine: ``no_sync`` on non-boundary micro-batches, one all-reduce round at the boundary."""

# No ``from __future__ import annotations`` here: DDP inspects the comm hook's real annotations.

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.engines.base import (
    EngineSpec,
    OptimizerFactory,
    StepResult,
    dcp_load,
    dcp_save,
    first_nonfinite,
    grads_of,
    scale_and_clip_,
)
from distaccum.telemetry.gns import GradSquares
from distaccum.telemetry.ledger import CommLedger


@dataclass
class HookState:
    """State of the gradient comm hook: the ledger it reports to, and the test-only fault switch."""

    ledger: CommLedger
    keep_local: bool = False
    """Fault injection: take part in the all-reduce but keep the local gradient (desyncs this rank)."""
    squares: GradSquares | None = None
    """When set (``log.gns``), the bucket's squared norm before and after the reduction."""


def mean_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket to the mean over ranks, counting every call and byte.

    Why the mean and not the sum: with ``accum.sync=every_micro`` the bucket holds the already
    reduced gradient of earlier micro-batches plus this rank's new contribution. The mean of
    identical values is that value, so only the new part is averaged; a sum would multiply the
    earlier part by the world size. The loop compensates the 1/world with ``grad_divisor``.
    """
    buffer = bucket.buffer()
    local = buffer.clone() if state.keep_local else None
    if state.squares is not None:  # this rank's accumulated gradient, before the reduction overwrites it
        state.squares.add_local(buffer)
    token = state.ledger.launched(buffer)
    buffer.div_(dist.get_world_size())
    future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.ledger.completed(token)
        if state.squares is not None:
            state.squares.add_reduced(fut.value()[0])
        return local if local is not None else fut.value()[0]

    return future.then(done)


def register_counting_hook(ddp: DDP, ledger: CommLedger, fault_rank: int | None,
                           squares: GradSquares | None = None) -> None:
    """Install :func:`mean_allreduce_hook` on ``ddp`` (also used on Accelerate's DDP module)."""
    state = HookState(ledger, keep_local=fault_rank is not None and fault_rank == dist.get_rank(), squares=squares)
    ddp.register_comm_hook(state, mean_allreduce_hook)


def step_plain(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], max_norm: float | None,
               grad_scale: torch.Tensor, scaler: "torch.amp.GradScaler | None", *,
               grads_to_none: bool = True) -> StepResult:
    """Normalize, clip and step gradients that live on whole parameters (DDP, Accelerate).

    With fp16 the GradScaler unscales first (once per step) and skips the update on overflow;
    otherwise a non-finite norm skips it. Reading the norm is this function's one host sync (the
    update is conditional on it); fp16 adds GradScaler's three (found-inf, the scale before and after).
    ``grads_to_none=False`` zeroes the gradients in place instead of dropping them: needed when they
    are views into DDP's buckets (see :meth:`DDPEngine.wrap`).
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = float(scale_and_clip_(grads_of(p for _, p in named), grad_scale, max_norm))
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(optimizer)  # skips the update when unscale_ found inf/nan
        scaler.update()
        applied = scaler.get_scale() >= before
    elif norm == norm and norm != float("inf"):
        optimizer.step()
        applied = True
    else:
        applied = False
    culprit = None if applied else first_nonfinite(named)
    optimizer.zero_grad(set_to_none=grads_to_none)
    return StepResult(norm, applied, culprit)


class DDPEngine:
    """torch DistributedDataParallel with a counting all-reduce (mean over ranks) comm hook."""

    name = "ddp"

    @classmethod
    def check(cls, spec: EngineSpec) -> None:
        """Nothing DDP cannot do; every precision works."""

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        self.spec = spec
        self.device = spec.device
        self.ledger = ledger
        self.precision = spec.precision
        self.scaler = torch.amp.GradScaler(self.device.type) if self.precision.loss_scaling else None
        # The hook averages over ranks: the loop multiplies the loss back by the world size.
        self.grad_divisor = float(dist.get_world_size())
        self.module: nn.Module | None = None
        self.raw: nn.Module | None = None
        self.grad_squares = GradSquares() if spec.gns else None
        """What the gradient noise scale reads each step (``log.gns``), filled by the comm hook."""

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        self.raw = model.to(device=self.device, dtype=self.precision.param_dtype)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # gradient_as_bucket_view: gradients live in DDP's buckets (no copy in or out of them). They
        # stay there only if the step zeroes them in place (step's grads_to_none=False): set to None,
        # the next window's no_sync backwards would allocate a second, separate set of gradients
        # that lives until the boundary copies it into the buckets -- one more copy of the
        # parameters' size at every K > 1, none at K = 1 (tests/test_engines_unit.py).
        ddp = DDP(self.raw, device_ids=device_ids, bucket_cap_mb=self.spec.engine.bucket_cap_mb,
                  gradient_as_bucket_view=True)
        register_counting_hook(ddp, self.ledger, self.spec.fault_rank, self.grad_squares)
        self.module = ddp
        self.optimizer = make_optimizer(list(self.raw.parameters()))
        return ddp

    def sync(self, enabled: bool) -> ContextManager[object]:
        assert isinstance(self.module, DDP)
        return contextlib.nullcontext() if enabled else self.module.no_sync()

    def forward_context(self) -> ContextManager[object]:
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_norm: float | None, grad_scale: torch.Tensor) -> StepResult:
        assert self.raw is not None
        return step_plain(self.optimizer, list(self.raw.named_parameters()), max_norm, grad_scale, self.scaler,
                          grads_to_none=False)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.raw is not None
        for name, param in self.raw.named_parameters():
            yield name, param.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.raw is not None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.raw.state_dict().items()}

    def unwrapped(self) -> nn.Module:
        assert self.raw is not None
        return self.raw

    def save_state(self, directory: Path) -> dict[str, Any]:
        assert self.raw is not None
        dcp_save(directory, self.raw, self.optimizer)  # replicated: written once, loadable on any world size
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        assert self.raw is not None
        dcp_load(directory, self.raw, self.optimizer)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])

    def teardown(self) -> None:
        self.module = None
