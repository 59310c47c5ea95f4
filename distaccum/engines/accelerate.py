"""Accelerate engine: ``Accelerator(gradient_accumulation_steps=K)`` and ``accumulate()``.

``accumulate()`` decides when gradients sync: it counts calls and syncs on every K-th (the loop's
windows always hold exactly K micro-batches, so that is the boundary), or on every call with
``accum.sync=every_micro`` (Accelerate's ``sync_each_batch``). We check that its decision is the
loop's on every micro-batch rather than trusting the two counters to stay in step.

Scaling: ``Accelerator.backward`` divides every loss by K, and Accelerate wraps the model in DDP. We register
DDP's counting comm hook on that DDP module (so the ledger counts these reductions too): a sum, or with
``accum.sync=every_micro`` a mean over the W ranks (:mod:`distaccum.engines.ddp` says why). Both divisions are
declared in ``grad_divisor`` (K, or K * W): the step sees the loop's sum and nothing else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ContextManager

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.engines.base import EngineSpec, OptimizerFactory, StepResult
from distaccum.engines.compile import compiled
from distaccum.engines.ddp import ReplicatedEngine
from distaccum.telemetry.ledger import CommLedger

MIXED_PRECISION = {"fp32": "no", "fp64": "no", "bf16": "bf16", "fp16": "fp16"}
"""Our precision names -> Accelerate's ``mixed_precision`` (it owns autocast and the GradScaler)."""


class AccelerateEngine(ReplicatedEngine):
    """An ``Accelerator`` driving DDP; gradient sync through ``accumulate()``."""

    name = "accelerate"
    ft_refusal = (
        "Accelerate steps its own wrapped optimizer, around which torchft's commit vote cannot sit; use engine=ddp "
        "(the same DDP) inside each group"
    )
    reentrant_checkpointing_safe = False  # Accelerate wraps the model in DDP

    @classmethod
    def check(cls, spec: EngineSpec) -> None:
        """On CPU Accelerate would silently train fp16 in fp32."""
        super().check(spec)
        if spec.precision.name == "fp16" and spec.device.type == "cpu":
            raise ValueError(
                "engine=accelerate precision=fp16 needs a GPU (on CPU Accelerate trains in "
                "fp32 without saying so); use bf16 or fp32 on CPU"
            )

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        super().__init__(spec, ledger)
        self.accum_steps = spec.split.accum_steps
        # Accelerator.backward divides by K; the comm hook averages over the W ranks with every_micro only.
        self.grad_divisor = float(self.accum_steps * (self.world if self.averages else 1))
        self.accelerator: Any = None
        self.module: nn.Module | None = None
        self.raw: nn.Module | None = None

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        from accelerate import Accelerator
        from accelerate.utils import GradientAccumulationPlugin

        plugin = GradientAccumulationPlugin(
            num_steps=self.accum_steps,
            sync_each_batch=self.spec.sync == "every_micro",
            sync_with_dataloader=False,
        )  # we bring our own batches
        self.accelerator = Accelerator(
            cpu=self.device.type == "cpu",
            mixed_precision=MIXED_PRECISION[self.precision.name],
            gradient_accumulation_plugin=plugin,
        )
        if self.accelerator.num_processes != dist.get_world_size():
            raise RuntimeError(
                f"Accelerate sees {self.accelerator.num_processes} process(es) but the process "
                f"group has {dist.get_world_size()}: start workers with torchrun-style "
                "variables (RANK, WORLD_SIZE, LOCAL_RANK), as distaccum's launcher does"
            )
        self.raw = model.to(dtype=self.precision.param_dtype)
        optimizer = make_optimizer(list(self.raw.parameters()))
        prepared, self.prepared_optimizer = self.accelerator.prepare(self.raw, optimizer)
        if isinstance(prepared, DDP):
            self.register_hook(prepared)
        elif dist.get_world_size() > 1:
            raise RuntimeError(f"Accelerate prepared a {type(prepared).__name__}, expected DDP")
        self.module = prepared
        self.optimizer = optimizer  # the torch optimizer our scheduler drives (Accelerate wraps it)
        self.scaler = self.accelerator.scaler  # Accelerate's GradScaler (fp16), driven by the shared step
        # Compiled like DDP's: accumulate() and no_sync act on the prepared module, the loop calls the compiled one.
        return compiled(prepared, self.spec.compile_mode) if self.spec.compile_mode else prepared

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        with self.accelerator.accumulate(self.module):
            will_reduce = self.accelerator.sync_gradients or self.spec.sync == "every_micro"
            if will_reduce != enabled:
                raise RuntimeError(
                    f"Accelerate's accumulate() would {'' if will_reduce else 'not '}sync "
                    f"this micro-batch but the loop says sync={enabled}: the counters drifted"
                )
            yield

    def forward_context(self) -> ContextManager[object]:
        # Accelerate wrapped the model's forward in autocast for bf16/fp16 already.
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)  # divides by K (declared in grad_divisor), scales fp16

    def step(self, max_norm: float | None, grad_scale: float) -> StepResult:
        if not self.accelerator.sync_gradients:
            raise RuntimeError(
                "Accelerate's accumulate() has not reached its boundary at the loop's "
                "optimizer step: its optimizer.step() would silently do nothing"
            )
        # The torch optimizer and Accelerate's GradScaler directly: the same unscale -> normalize
        # -> clip -> step as DDP (Accelerate's prepared optimizer would only add its own checks).
        return super().step(max_norm, grad_scale)

    def teardown(self) -> None:
        if self.accelerator is not None:
            self.accelerator.free_memory()  # drops its references to the model and optimizer
        self.module = self.raw = self.accelerator = None
        self.scaler = None
