"""DDP engine: ``no_sync`` on non-boundary micro-batches, one all-reduce round at the boundary."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.engines.base import EngineSpec, OptimizerFactory
from distaccum.engines.compile import compiled
from distaccum.engines.replicated import ReplicatedEngine
from distaccum.telemetry.gns import GradSquares
from distaccum.telemetry.ledger import CommLedger


class DDPEngine(ReplicatedEngine):
    """torch DistributedDataParallel with a counting all-reduce (mean over ranks) comm hook."""

    name = "ddp"
    supports_gns = True
    reentrant_checkpointing_safe = False  # "Expected to mark a variable ready only once" (see activation_checkpointing)
    grads_to_none = False  # gradients are views into DDP's buckets: zeroed in place (see wrap)

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        super().__init__(spec, ledger)
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
        # stay there only if the step zeroes them in place (grads_to_none=False): set to None, the
        # next window's no_sync backwards would allocate a second, separate set of gradients that
        # lives until the boundary copies it into the buckets -- one more copy of the parameters'
        # size at every K > 1, none at K = 1 (tests/test_engines_unit.py).
        ddp = DDP(self.raw, device_ids=device_ids, bucket_cap_mb=self.spec.engine.bucket_cap_mb,
                  gradient_as_bucket_view=True)
        self.register_hook(ddp)
        self.module = ddp
        self.optimizer = make_optimizer(list(self.raw.parameters()))
        # Compiled: the loop calls the compiled DDP; no_sync stays on the DDP module itself (engines.compile).
        return compiled(ddp, self.spec.compile_mode) if self.spec.compile_mode else ddp

    def sync(self, enabled: bool) -> ContextManager[object]:
        assert isinstance(self.module, DDP)
        return contextlib.nullcontext() if enabled else self.module.no_sync()

    def forward_context(self) -> ContextManager[object]:
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def teardown(self) -> None:
        self.module = None
