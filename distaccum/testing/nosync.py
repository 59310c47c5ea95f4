"""The bug zoo's misplaced gradient synchronization, as peers shipped it in 2025–26: each a fault that wraps the
real engine, so the real DDP or FSDP2 module decides what is reduced.

- :class:`NoSyncAroundBackward` (LoongForge #163): ``no_sync`` entered around the backward only. DDP decides in
  the forward whether the backward reduces (its ``_post_forward`` arms the reducer unless ``no_sync`` is on), so
  every micro-batch all-reduces.
- :class:`DDPOnlyNoSync` (cosmos-framework #161): a ``no_sync`` helper that only knows DDP; under FSDP2 it does
  nothing, so every micro-batch reduce-scatters.
- :class:`NestedDDP` (torchrec #4121): a DDP wrapper inside the model (its block's parameters left out of the
  outer DDP, as torchrec's data-parallel wrapper does); the outer ``no_sync`` does not reach it.
- :class:`FirstMicroSync` (FunASR #3472): ``batch_idx % accum_grad == 0`` as the sync condition: the first
  micro-batch reduces, the window's last does not.

Engine ``ddp`` for all but :class:`DDPOnlyNoSync` (any engine; the zoo runs it on ``fsdp``).
"""

# No ``from __future__ import annotations``: DDP inspects a comm hook's real annotations (faults.py).

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.engines.ddp import DDPEngine
from distaccum.models import block_units
from distaccum.testing.faults import Proxy
from distaccum.testing.zoo import MicroCounter


def ddp_only(fault: Any, obj: Any) -> DDPEngine:
    """``obj``, a DDP engine, or a ValueError naming the fault."""
    if not isinstance(obj, DDPEngine):
        raise ValueError(f"{type(fault).__name__} drives a DDP module; engine {obj.name!r} is not DDP")
    return obj


class BackwardOnlySync(Proxy):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        object.__setattr__(self, "reduce", True)

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        object.__setattr__(self, "reduce", enabled)
        yield  # the forward runs outside no_sync: DDP has armed its reducer by the time backward runs

    def backward(self, loss: torch.Tensor) -> None:
        with self.inner.sync(self.reduce):  # the engine's real no_sync, around the backward alone
            self.inner.backward(loss)


class NoSyncAroundBackward:
    """``no_sync`` around the backward only (LoongForge #163): the loop's forward runs outside it, so DDP arms its
    reducer in every forward and every micro-batch all-reduces. Engine ``ddp``."""

    def wrap(self, point: str, obj: Any) -> Any:
        return BackwardOnlySync(ddp_only(self, obj)) if point == "engine" else obj


class DDPOnlySync(Proxy):
    def sync(self, enabled: bool) -> Any:
        module = self.inner.module
        # The helper's test: a DDP module gets no_sync off the boundary; anything else (FSDP2's fully_shard
        # modules) nothing, so FSDP2 keeps its default, a reduce-scatter after every backward.
        return module.no_sync() if not enabled and isinstance(module, DDP) else contextlib.nullcontext()


class DDPOnlyNoSync:
    """A ``no_sync`` helper that only knows DDP (cosmos-framework #161: ``isinstance(model, DDP)``, else nothing):
    under FSDP2 every micro-batch reduce-scatters, K = 4 costs 4 reductions. The gradient stays right (FSDP2 sums
    fresh reduce-scatters); the communication is K times what ``accum.sync=boundary`` promises."""

    def wrap(self, point: str, obj: Any) -> Any:
        return DDPOnlySync(obj) if point == "engine" else obj


class NestedEngine(Proxy):
    def wrap(self, model: torch.nn.Module, make_optimizer: Any) -> Any:
        engine: DDPEngine = self.inner
        unit = block_units(model)[0]
        prefix = next(name for name, m in model.named_modules() if m is unit)
        # The inner wrapper: a real DDP of the block, made as the engine makes its own (its arguments, its
        # counting comm hook, so the ledger sees its all-reduces); the outer DDP leaves its parameters to it.
        inner = DDP(unit, **engine.ddp_arguments())
        engine.register_hook(inner)
        DDP._set_params_and_buffers_to_ignore_for_model(
            model, [f"{prefix}.{name}" for name, _ in [*unit.named_parameters(), *unit.named_buffers()]]
        )
        route_through(unit, inner)
        object.__setattr__(self, "nested", inner)  # kept alive with the engine
        return engine.wrap(model, make_optimizer)


def route_through(unit: torch.nn.Module, wrapper: torch.nn.Module) -> None:
    """Calls of ``unit`` go through ``wrapper`` (a DDP of ``unit``), whose own call of ``unit`` runs the real forward.
    The block stays where it is in the model: its parameters keep their names."""
    forward = type(unit).forward
    inside = [False]

    def routed(*args: Any, **kwargs: Any) -> Any:
        if inside[0]:
            return forward(unit, *args, **kwargs)
        inside[0] = True
        try:
            return wrapper(*args, **kwargs)
        finally:
            inside[0] = False

    unit.forward = routed


class NestedDDP:
    """Nested DDP wrappers (torchrec #4121): the model's first block is wrapped in its own
    ``DistributedDataParallel`` and left out of the engine's (outer) one; the loop's ``no_sync`` reaches only the
    outer wrapper, so the inner one all-reduces the block's gradient after every micro-batch. Engine ``ddp``."""

    def wrap(self, point: str, obj: Any) -> Any:
        return NestedEngine(ddp_only(self, obj)) if point == "engine" else obj


class FirstMicro(MicroCounter):
    def sync(self, enabled: bool) -> Any:
        k = self.micro()
        self.next_micro()
        return self.inner.sync(k == 0)  # batch_idx % accum_grad == 0: true on the window's first micro-batch


class FirstMicroSync:
    """The off-by-one of FunASR #3472: gradients sync when ``batch_idx % accum_grad == 0``, on the window's first
    micro-batch, and the micro-batch the optimizer steps after stays in ``no_sync``: the ranks step on their own
    accumulations of micro-batches 2..K. Correct only at K = 1."""

    def wrap(self, point: str, obj: Any) -> Any:
        return FirstMicro(ddp_only(self, obj)) if point == "engine" else obj
