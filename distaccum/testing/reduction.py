"""Faults in the gradient reduction itself, for the sharded engines' reduction checksum: the reduction skipped,
doubled or scaled wrongly, on the real collectives FSDP2 and DeepSpeed issue.

:class:`SkippedBoundarySync` is the FSDP2 bug as users write it (a ``no_sync`` helper that never turns sync back on
at the boundary: no reduce-scatter ever runs). :class:`CorruptReduction` wraps the reducing collectives
torch.distributed runs while the engine's backward and boundary run (the ones :mod:`distaccum.engines.comm_tap`
counts): each still runs on every rank (nothing hangs), then its result is replaced by this rank's own unreduced
piece (``skip``) or multiplied (``scale``: 2 is a doubled reduction).
"""

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from distaccum.testing.faults import Proxy, rank

IN_PLACE = ("all_reduce", "reduce")
"""Reductions whose result replaces their input tensor (argument 0)."""
SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter")
"""Reduce-scatters: output (argument 0), input or input list (argument 1)."""

_inside = threading.local()


class NeverSyncing(Proxy):
    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        with self.inner.sync(False):
            yield


class SkippedBoundarySync:
    """A ``no_sync`` helper that never re-enables gradient sync: every micro-batch, the window's last too, runs
    with ``set_requires_gradient_sync(False)`` on FSDP2, so no reduce-scatter runs, the sharded gradients are never
    written and the optimizer steps without them (on every rank alike: nothing diverges, nothing hangs)."""

    def wrap(self, point: str, obj: Any) -> Any:
        return NeverSyncing(obj) if point == "engine" else obj


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], position: int, keyword: str) -> Any:
    return args[position] if len(args) > position else kwargs[keyword]


def corrupted(name: str, original: Callable[..., Any], mode: str, factor: float) -> Callable[..., Any]:
    """``original`` (a reducing collective) run as it is, its result then replaced or scaled."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "active", False):  # an alias calling the real op: corrupted once, by the caller
            return original(*args, **kwargs)
        position = 2 if name == "all_reduce" else 3
        group = args[position] if len(args) > position else kwargs.get("group")
        if name in IN_PLACE:
            out = _argument(args, kwargs, 0, "tensor")
            local = out.clone()
        else:
            out = _argument(args, kwargs, 0, "output")
            pieces = _argument(args, kwargs, 1, "input" if name != "reduce_scatter" else "input_list")
            me = dist.get_rank(group)
            local = (
                pieces[me] if isinstance(pieces, list) else pieces.reshape(dist.get_world_size(group), -1)[me]
            )
            local = local.clone()
        _inside.active = True
        try:
            work = original(*args, **kwargs)
        finally:
            _inside.active = False
        if work is not None:
            work.wait()
        with torch.no_grad():
            if mode == "skip":
                out.copy_(local.view_as(out))
            else:
                out.mul_(factor)
        return work

    return call


class CorruptingEngine(Proxy):
    def __init__(self, inner: Any, mode: str, factor: float, from_step: int) -> None:
        super().__init__(inner)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "factor", factor)
        object.__setattr__(self, "from_step", from_step)
        object.__setattr__(self, "micro", 0)

    @contextlib.contextmanager
    def _corrupting(self) -> Iterator[None]:
        step = self.micro // self.inner.spec.split.accum_steps + 1
        if step < self.from_step:
            yield
            return
        saved = []
        try:
            for module in (dist, c10d):
                for name in (*IN_PLACE, *SCATTERS):
                    original = getattr(module, name, None)
                    if original is not None:
                        saved.append((module, name, original))
                        setattr(module, name, corrupted(name, original, self.mode, self.factor))
            yield
        finally:
            for module, name, original in reversed(saved):
                setattr(module, name, original)

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        with self._corrupting(), self.inner.sync(enabled):  # DeepSpeed's window reduction runs as sync exits
            yield
        object.__setattr__(self, "micro", self.micro + 1)

    def backward(self, loss: torch.Tensor) -> None:
        with self._corrupting():
            self.inner.backward(loss)


class CorruptReduction:
    """From optimizer step ``from_step`` on, every gradient reduction the engine runs (reducing collectives inside
    its backward and boundary) is ``skip``-ped (each rank keeps its own unreduced piece) or ``scale``-d by ``factor``
    (2: a doubled reduction; 1/W or W: a mean where a sum belongs, or the reverse), on ``ranks`` (None: all)."""

    def __init__(
        self, mode: str = "skip", factor: float = 1.0, from_step: int = 1, ranks: list[int] | None = None
    ) -> None:
        if mode not in ("skip", "scale"):
            raise ValueError(f"CorruptReduction mode {mode!r}: skip or scale")
        self.mode, self.factor, self.from_step, self.ranks = mode, factor, from_step, ranks

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "engine" or (self.ranks is not None and rank() not in self.ranks):
            return obj
        return CorruptingEngine(obj, self.mode, self.factor, self.from_step)
