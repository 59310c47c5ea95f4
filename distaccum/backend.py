"""The one backend protocol every engine implements, plus the precision policy they share.

The training loop talks only to :class:`Backend`; there is no ``if engine == ...`` anywhere else.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Protocol

import torch
from torch import nn

from distaccum.comm import CommLedger
from distaccum.config import RunConfig

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Precision:
    """How a precision name maps to parameter dtype, autocast and loss scaling."""

    name: str
    param_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    loss_scaling: bool

    @classmethod
    def of(cls, name: str) -> Precision:
        return {
            "fp32": cls("fp32", torch.float32, None, False),
            "fp64": cls("fp64", torch.float64, None, False),
            "bf16": cls("bf16", torch.float32, torch.bfloat16, False),
            "fp16": cls("fp16", torch.float32, torch.float16, True),
        }[name]

    def autocast(self, device: torch.device) -> ContextManager[object]:
        """Autocast for the forward pass (a no-op for fp32/fp64)."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


class Backend(Protocol):
    """What the loop needs from an engine. One implementation per engine.

    ``grad_divisor`` states how the engine itself scales the summed gradient: the loop multiplies
    each micro-batch loss by it so that, after the engine's own division, the step sees
    sum(loss items over the window and all ranks) / global item count — and nothing else.
    """

    name: str
    grad_divisor: float
    optimizer: torch.optim.Optimizer

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        """Wrap ``model`` for data parallelism and create the optimizer; returns the module to call."""
        ...

    def sync(self, enabled: bool) -> ContextManager[object]:
        """Context for one micro-batch's forward+backward: reduce gradients iff ``enabled``."""
        ...

    def forward_context(self) -> ContextManager[object]:
        """Autocast (or nothing) around the forward pass."""
        ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of an already normalized micro-batch loss (no further scaling by the caller)."""
        ...

    def clip_grad_norm(self, max_norm: float | None) -> float:
        """Unscale (fp16), return the global gradient norm, clip to ``max_norm`` when set."""
        ...

    def step(self) -> bool:
        """Optimizer step and zero grads; False when skipped (fp16 overflow)."""
        ...

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, unsharded, in a stable order. Collective: all ranks must iterate."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Model, optimizer and loss-scaler state for a checkpoint. Collective on sharded engines."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on every rank)."""
        ...

    def teardown(self) -> None:
        """Release engine resources (the process group is destroyed by the worker entry)."""
        ...


def make_backend(cfg: RunConfig, device: torch.device, ledger: CommLedger) -> Backend:
    """The backend for ``cfg.engine.name``. Engines import lazily: their packages are optional."""
    name = cfg.engine.name
    if name == "ddp":
        from distaccum.engine_ddp import DDPBackend

        return DDPBackend(cfg, device, ledger)
    if name == "fsdp":
        from distaccum.engine_fsdp import FSDPBackend

        return FSDPBackend(cfg, device, ledger)
    if name == "deepspeed":
        from distaccum.engine_deepspeed import DeepSpeedBackend

        return DeepSpeedBackend(cfg, device, ledger)
    if name == "accelerate":
        from distaccum.engine_accelerate import AccelerateBackend

        return AccelerateBackend(cfg, device, ledger)
    raise ValueError(f"unknown engine {name!r}")
