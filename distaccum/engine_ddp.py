"""DDP engine: ``no_sync`` on non-boundary micro-batches, one SUM all-reduce round at the boundary."""

# No ``from __future__ import annotations`` here: DDP inspects the comm hook's real annotations.

import contextlib
from dataclasses import dataclass
from typing import ContextManager, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.backend import OptimizerFactory, Precision
from distaccum.comm import CommLedger
from distaccum.config import RunConfig


@dataclass
class HookState:
    """State of the gradient comm hook: the ledger it reports to, and the test-only fault switch."""

    ledger: CommLedger
    keep_local: bool = False
    """Fault injection: take part in the all-reduce but keep the local gradient (desyncs this rank)."""


def sum_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket with SUM (DDP's default divides by world size; we don't).

    Summing keeps the normalization in one visible place, the loop's division by the global item
    count. Every call and byte is reported to the ledger.
    """
    buffer = bucket.buffer()
    local = buffer.clone() if state.keep_local else None
    token = state.ledger.launched(buffer)
    future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def done(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.ledger.completed(token)
        return local if local is not None else fut.value()[0]

    return future.then(done)


class DDPBackend:
    """torch DistributedDataParallel with a counting SUM all-reduce hook."""

    name = "ddp"
    grad_divisor = 1.0  # the hook sums; nothing divides the gradient after the loop's normalization

    def __init__(self, cfg: RunConfig, device: torch.device, ledger: CommLedger) -> None:
        self.cfg = cfg
        self.device = device
        self.ledger = ledger
        self.precision = Precision.of(cfg.precision)
        self.scaler = torch.amp.GradScaler(device.type) if self.precision.loss_scaling else None
        self.module: nn.Module | None = None
        self.raw: nn.Module | None = None

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        self.raw = model.to(device=self.device, dtype=self.precision.param_dtype)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DDP(self.raw, device_ids=device_ids, bucket_cap_mb=self.cfg.engine.bucket_cap_mb)
        fault_rank = self.cfg.debug.skip_reduction_rank
        state = HookState(self.ledger, keep_local=fault_rank is not None and fault_rank == dist.get_rank())
        ddp.register_comm_hook(state, sum_allreduce_hook)
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

    def clip_grad_norm(self, max_norm: float | None) -> float:
        assert self.raw is not None
        if self.scaler:
            self.scaler.unscale_(self.optimizer)  # once per step, right before clipping
        norm = torch.nn.utils.clip_grad_norm_(self.raw.parameters(), max_norm or float("inf"))
        return float(norm)

    def step(self) -> bool:
        stepped = True
        if self.scaler:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skips the update when unscale_ found inf/nan
            self.scaler.update()
            stepped = self.scaler.get_scale() >= before
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return stepped

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.raw is not None
        for name, param in self.raw.named_parameters():
            yield name, param.detach()

    def teardown(self) -> None:
        self.module = None
