"""FSDP2 engine: ``fully_shard`` per block, reduce-scatter at the boundary or after every micro-batch.

- ``accum.sync=boundary``: ``set_requires_gradient_sync(False)`` on micro-batches 1..K-1, so each
  unit keeps its *unsharded* gradient until the last micro-batch reduce-scatters it once — one
  reduce-scatter round per optimizer step, but a full gradient's worth of memory per rank.
- ``accum.sync=every_micro``: every micro-batch reduce-scatters and frees the unsharded gradient,
  accumulating into the 1/W sharded one — K rounds (K x the bytes), the memory-saving mode.
- ``engine.fsdp_unsharded_window=true``: parameters stay unsharded from the window's first forward
  to its last backward (``reshard_after_forward=False`` and ``set_reshard_after_backward(False)``
  until the boundary): one parameter all-gather per unit per step instead of two per micro-batch,
  for a full copy of the parameters in memory during the window.

Reduction is a plain SUM (``grad_divisor = 1``): the loop's division by the global item count
stays the only normalization. FSDP2's default is a mean over ranks; keeping it and declaring
``grad_divisor = world`` would work too, but a custom divide factor runs as
``ReduceOp.PREMUL_SUM``, which gloo rejects, so we set factor 1 *and* force plain SUM comms. (DDP
must average instead: its every_micro buckets hold already-reduced gradients; FSDP2's reduce-scatter
always takes fresh unsharded gradients, so a sum is exact.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from distaccum.engines.base import (
    EngineBase,
    EngineSpec,
    OptimizerFactory,
    Precision,
    StepResult,
    dcp_load,
    dcp_save,
    step_plain,
)
from distaccum.engines.comm_tap import tap_gradient_reductions, tap_parameter_gathers
from distaccum.engines.compile import compile_in_place
from distaccum.models import block_units
from distaccum.telemetry.ledger import CommLedger


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules sharded on their own (each is all-gathered/reduce-scattered as one unit).

    The model's blocks (:func:`distaccum.models.block_units`: a Hugging Face model's
    ``_no_split_modules`` layers, else the children of the largest ``nn.ModuleList``); without
    blocks, every Linear/Conv layer, so at most one layer is unsharded at a time. The root module
    takes whatever is left (embeddings, final norm, head).
    """
    units = block_units(model)
    if units:
        return units
    return [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d)]


def mixed_precision(precision: Precision, reduce_fp32: bool) -> MixedPrecisionPolicy:
    """bf16: parameters all-gathered in bf16; gradients reduced in fp32 unless ``reduce_fp32`` is off."""
    if precision.autocast_dtype is None:
        return MixedPrecisionPolicy()
    low = precision.autocast_dtype
    return MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32 if reduce_fp32 else low)


class FSDPEngine(EngineBase):
    """torch FSDP2 (``fully_shard``) with SUM reduce-scatters reported to the ledger by a tap."""

    name = "fsdp"
    grad_divisor = 1.0  # SUM reduction (see the module docstring): nothing divides after the loop

    @classmethod
    def check(cls, spec: EngineSpec) -> None:
        """fp16 needs a sharded GradScaler, which distaccum does not drive."""
        if spec.precision.loss_scaling:
            raise ValueError("precision=fp16 with engine=fsdp is unsupported (GradScaler needs the sharded "
                             "scaler); use bf16 or fp32")

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        super().__init__(spec, ledger)
        self.module: nn.Module | None = None
        self._micro = 0

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        model = model.to(device=self.device, dtype=self.precision.param_dtype)
        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        policy = mixed_precision(self.precision, self.spec.engine.fsdp_reduce_fp32)
        keep = self.spec.engine.fsdp_unsharded_window
        for unit in shard_units(model):
            if self.spec.compile_mode:  # per block, before sharding: FSDP's hooks run between compiled blocks
                compile_in_place(unit, self.spec.compile_mode)
            fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=not keep)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        for module in model.modules():  # both setters act on one FSDP unit, not recursively
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self.module = model
        self.optimizer = make_optimizer(list(model.parameters()))  # over the sharded DTensors
        return model

    def _fsdp(self) -> FSDPModule:
        assert isinstance(self.module, FSDPModule)
        return self.module

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        # Both setters recurse into every unit; the reduce-scatter runs in the post-backward hooks.
        self._fsdp().set_requires_gradient_sync(enabled)
        if self.spec.engine.fsdp_unsharded_window:
            # Reshard only after the window's last backward (the boundary); every_micro reduces on
            # every micro-batch but can still keep the parameters gathered in between.
            self._fsdp().set_reshard_after_backward(self._micro_is_last())
        yield

    def _micro_is_last(self) -> bool:
        self._micro += 1  # the loop's windows always hold exactly K micro-batches
        return self._micro % self.spec.split.accum_steps == 0

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        # The tap counts the parameter all-gathers the forward issues (and nothing else there).
        with self.precision.autocast(self.device), tap_parameter_gathers(self.ledger):
            yield

    def backward(self, loss: torch.Tensor) -> None:
        # Reduce-scatters run inside backward (post-backward hooks, waited for by the root's final
        # callback), so the tap sees exactly the gradient collectives of this micro-batch.
        with tap_gradient_reductions(self.ledger, gathers=True):  # + re-gathers for the backward
            loss.backward()

    def step(self, max_norm: float | None, grad_scale: torch.Tensor) -> StepResult:
        assert self.module is not None
        # Sharded DTensor gradients: per-shard norms and one all-reduce for the total (not a gradient
        # reduction, and outside the tap); the multiply acts on the local shards.
        return step_plain(self.optimizer, list(self.module.named_parameters()), max_norm, grad_scale, None)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.module is not None
        # fully_shard swaps parameters in place: names and order are the plain model's.
        for name, param in self.module.named_parameters():
            if isinstance(param, DTensor):
                yield name, param.full_tensor().detach()  # an all-gather: every rank iterates
            else:
                yield name, param.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        assert self.module is not None
        # Gathered shard by shard onto rank 0's CPU (the other ranks get an empty dict).
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return dict(get_model_state_dict(self.module, options=options))

    def unwrapped(self) -> nn.Module:
        assert self.module is not None
        return self.module

    def save_state(self, directory: Path) -> dict[str, Any]:
        assert self.module is not None
        dcp_save(directory, self.module, self.optimizer)  # each rank writes its own shards: no gather
        return {}

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        assert self.module is not None
        dcp_load(directory, self.module, self.optimizer)  # reshards onto this world size

    def teardown(self) -> None:
        # Drop the sharded module and optimizer before the barrier and destroy_process_group; the
        # CLI worker then leaves with os._exit (see cli.worker).
        self.module = None
        self.optimizer = None  # type: ignore[assignment]
