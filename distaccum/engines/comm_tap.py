"""A tap on torch.distributed reductions, for engines whose gradient collectives we cannot hook.

DDP takes a comm hook; FSDP2 and DeepSpeed call torch.distributed themselves. What they call
(checked by tracing every collective of a K=4 run on gloo, torch 2.13, DeepSpeed 0.19.8):

==============  ========================================  ============================================
engine          gradient reduction, inside backward()     other collectives (not counted)
==============  ========================================  ============================================
FSDP2           ``dist.reduce_scatter_single`` per unit   ``all_gather_single`` (parameters)
ZeRO-0 / 1      ``dist.all_reduce`` at the boundary       grad-norm ``all_reduce`` and parameter
                                                          ``all_gather_into_tensor`` in ``step()``
ZeRO-2          ``dist.all_reduce`` every micro-batch     same as ZeRO-1
ZeRO-3          ``reduce_scatter_tensor`` every micro     parameter all-gathers and broadcasts in
                (it calls ``reduce_scatter_single``)      forward, backward and ``step()``
==============  ========================================  ============================================

So a gradient reduction is: a *reducing* collective issued while the engine's backward runs. The
tap is a context manager the engine enters around its backward call only; it never wraps
all-gathers (parameters) and is not active during the loop's own all-reduces (item counts, norms).
DeepSpeed keeps a reference to ``reduce_scatter_tensor`` from its start-up, which is why the
``distributed_c10d`` module functions are wrapped too; nested calls (a deprecated alias calling
the new name) are counted once, at the outermost call.

Under FSDP2 hybrid sharding (HSDP) the engine names its cross-replica process group: a reduction on
it (the all-reduce that follows the reduce-scatter) is reported as a cross-replica collective
(``comm_*_replicate`` in the ledger), every other one as an in-replica collective.

Parameter all-gathers are counted separately (``CommLedger.gathered``: calls and bytes, no times)
when an engine asks for them: FSDP2 taps its forward with :func:`tap_parameter_gathers` and its
backward with ``tap_gradient_reductions(ledger, gathers=True)``, so a step's count covers the
forward gathers and the backward re-gathers. DeepSpeed does not ask (its count stays 0): ZeRO-1/2
gather parameters inside ``step()``, outside any tap, so a count would be partial.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from distaccum.telemetry.ledger import CommLedger

REDUCTIONS: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"),
    "all_reduce_coalesced": (0, "tensors"),
    "reduce": (0, "tensor"),
    "reduce_scatter": (1, "input_list"),
    "reduce_scatter_single": (1, "input"),
    "reduce_scatter_tensor": (1, "input"),
    "_reduce_scatter_base": (1, "input"),
}
"""Reducing collectives of torch.distributed -> (positional index, keyword) of the tensor reduced."""

GROUP_POSITION = {
    "all_reduce": 2,
    "all_reduce_coalesced": 2,
    "reduce": 3,
    "reduce_scatter": 3,
    "reduce_scatter_single": 3,
    "reduce_scatter_tensor": 3,
    "_reduce_scatter_base": 3,
}
"""Reducing collective -> positional index of its ``group`` argument."""

GATHERS: dict[str, tuple[int, str]] = {
    "all_gather": (0, "tensor_list"),
    "all_gather_single": (0, "output_tensor"),
    "all_gather_into_tensor": (0, "output_tensor"),
    "_all_gather_base": (0, "output_tensor"),
}
"""All-gathers of torch.distributed -> (positional index, keyword) of the gathered (output) tensor."""

_state = threading.local()
_active = False


def reduced_input(
    name: str, args: tuple[Any, ...], kwargs: dict[str, Any], table: dict[str, tuple[int, str]] = REDUCTIONS
) -> torch.Tensor:
    """The tensor a reduction reduces (a gather: gathers into, with ``table=GATHERS``); a list of
    tensors becomes one meta tensor of their total size."""
    position, keyword = table[name]
    value = args[position] if len(args) > position else kwargs[keyword]
    if isinstance(value, torch.Tensor):
        return value
    tensors = list(value)
    numel = sum(t.numel() for t in tensors)
    return torch.empty(numel, dtype=tensors[0].dtype if tensors else torch.float32, device="meta")


def group_of(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The process group a reducing collective runs on (None: the default group)."""
    position = GROUP_POSITION[name]
    return args[position] if len(args) > position else kwargs.get("group")


def _outermost(original: Callable[..., Any], call: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` wrapped to run ``call`` instead, except inside another wrapped collective."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if getattr(_state, "inside", False):  # an alias calling the real op: counted by the caller
            return original(*args, **kwargs)
        _state.inside = True
        try:
            return call(*args, **kwargs)
        finally:
            _state.inside = False

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


def _counting(
    name: str, original: Callable[..., Any], ledger: CommLedger, replicate_group: str | None = None
) -> Callable[..., Any]:
    def count(*args: Any, **kwargs: Any) -> Any:
        tensor = reduced_input(name, args, kwargs)
        group = group_of(name, args, kwargs)
        replicate = replicate_group is not None and getattr(group, "group_name", None) == replicate_group
        if not kwargs.get("async_op", False):
            with ledger.blocking(tensor, replicate=replicate):
                return original(*args, **kwargs)
        token = ledger.launched(tensor, replicate=replicate)
        work = original(*args, **kwargs)
        if work is None:  # this rank is not in the group: nothing was sent
            ledger.completed(token)
        else:
            ledger.completes_with(token, work.get_future())
        return work

    return _outermost(original, count)


def _gathering(
    name: str, original: Callable[..., Any], ledger: CommLedger, replicate_group: str | None = None
) -> Callable[..., Any]:
    def count(*args: Any, **kwargs: Any) -> Any:
        tensor = reduced_input(name, args, kwargs, GATHERS)
        ledger.gathered(tensor.numel() * tensor.element_size())
        return original(*args, **kwargs)

    return _outermost(original, count)


@contextmanager
def tap_gradient_reductions(
    ledger: CommLedger, *, gathers: bool = False, replicate_group: str | None = None
) -> Iterator[None]:
    """Report every reducing collective issued inside the block to ``ledger`` (and, with
    ``gathers``, count every all-gather as a parameter gather). A reduction on the process group named
    ``replicate_group`` (HSDP's cross-replica group) is reported as a cross-replica collective.

    Enter it around the engine's backward call only (that is what makes a reduction a *gradient*
    reduction). Not re-entrant; the module attributes are restored on exit, even on error.
    """
    wrappers = {name: _counting for name in REDUCTIONS}
    if gathers:
        wrappers.update({name: _gathering for name in GATHERS})
    with _patched(wrappers, ledger, replicate_group):
        yield


@contextmanager
def tap_parameter_gathers(ledger: CommLedger) -> Iterator[None]:
    """Count every all-gather issued inside the block as a parameter gather (around a forward)."""
    with _patched({name: _gathering for name in GATHERS}, ledger):
        yield


@contextmanager
def _patched(
    wrappers: dict[str, Callable[..., Any]], ledger: CommLedger, replicate_group: str | None = None
) -> Iterator[None]:
    global _active
    if _active:
        raise RuntimeError("the collective tap is already active (it is not re-entrant)")
    _active = True
    saved: list[tuple[Any, str, Any]] = []
    try:
        for module in (dist, c10d):
            for name, wrap in wrappers.items():
                original = getattr(module, name, None)
                if original is not None:
                    saved.append((module, name, original))
                    setattr(module, name, wrap(name, original, ledger, replicate_group))
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)
        _active = False
