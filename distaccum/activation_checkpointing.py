"""Activation checkpointing: chosen modules keep only their inputs and recompute the rest in backward.

Accumulation shrinks the micro-batch until it fits; when even micro-batch 1 does not fit, the
activations autograd keeps between forward and backward are what to cut. A checkpointed module
saves its inputs instead of every intermediate tensor and runs its forward again during backward:
roughly one extra forward per step for memory that no longer grows with depth.

How distaccum applies it (``model.activation_checkpointing``, ``Trainer(activation_checkpointing=)``
or :func:`apply_activation_checkpointing` in your own code):

- ``blocks`` on a Hugging Face ``PreTrainedModel``: its own ``activation_checkpointing_enable``
  (``gradient_checkpointing_enable`` before transformers 5) with ``use_reentrant=False``.
- Otherwise each chosen module's ``forward`` is replaced, on that instance, by a call through
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` — what transformers' own
  ``GradientCheckpointingLayer`` does. Module hooks run in ``__call__`` around ``forward``, so the
  engines' hooks (FSDP2's unshard/reshard, ZeRO-3's gather, DDP's) stay outside the checkpointed
  region and do not run again on recompute; parameter names, state dicts and the module tree are
  unchanged (torch's ``checkpoint_wrapper`` would insert ``_checkpoint_wrapped_module`` into every
  name), so parameter digests, ``verify`` and the saved weights are the plain model's.

Recomputation replays the same operations with the same RNG state (``preserve_rng_state``), so
losses and gradients are bit-for-bit those of the run without checkpointing, dropout included.

Only the non-reentrant variant: the reentrant one runs a nested backward per checkpoint, and DDP
(also under Accelerate) fails with "Expected to mark a variable ready only once" as soon as a
parameter takes part in two of them (pytorch#121594). :func:`check_engine_compatible` refuses a
model that already checkpoints reentrantly (a factory that called ``gradient_checkpointing_enable``
with ``use_reentrant=True``, or wrapped modules with torch's reentrant ``checkpoint_wrapper``).
"""

from __future__ import annotations

import fnmatch
import types
from collections.abc import Sequence
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from distaccum.engines import engine_class
from distaccum.models import block_units

Checkpointing = str | tuple[str, ...] | None
"""None (off), ``"blocks"``, or module-name patterns (``fnmatch``, matched against ``named_modules``)."""


def parse_checkpointing(value: Any, where: str = "model.activation_checkpointing") -> Checkpointing:
    """Normalize a user's setting: ``none``/None -> None, ``blocks``, or a list of patterns -> tuple."""
    if value is None or value == "none":
        return None
    if value == "blocks":
        return "blocks"
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        patterns = tuple(value)
        if patterns and all(isinstance(p, str) and p.strip() for p in patterns):
            return patterns
    hint = f"; for one module-name pattern write [{value}]" if isinstance(value, str) else ""
    raise ValueError(
        f"{where}={value!r} is not none, blocks or a non-empty list of module-name patterns "
        f"(e.g. [blocks.0, 'layers.*.mlp']){hint}"
    )


def _hf_checkpointing(model: nn.Module) -> Callable[..., Any] | None:
    """The Hugging Face enabling method of a ``PreTrainedModel`` that supports checkpointing, or None."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return None
    return getattr(model, "activation_checkpointing_enable", None) or getattr(
        model, "gradient_checkpointing_enable", None
    )


def _named(model: nn.Module) -> dict[int, str]:
    return {id(m): name for name, m in model.named_modules()}


def select_modules(model: nn.Module, spec: Checkpointing) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs ``spec`` checkpoints, outermost only (a module inside a chosen one
    is recomputed with it anyway). Raises ValueError when ``blocks`` finds no blocks or a pattern
    matches no module."""
    if spec is None:
        return []
    names = _named(model)
    model_name = type(model).__name__
    if spec == "blocks":
        units = block_units(model)
        if not units:
            raise ValueError(
                f"model.activation_checkpointing=blocks: {model_name} has no blocks (no Hugging Face "
                "_no_split_modules, no nn.ModuleList); name the modules to checkpoint instead, "
                f"e.g. model.activation_checkpointing=[{_examples(model)[0]}]"
            )
        return [(names[id(m)], m) for m in units]
    chosen: dict[str, nn.Module] = {}
    for pattern in spec:
        found = {n: m for n, m in model.named_modules() if n and fnmatch.fnmatchcase(n, pattern)}
        if not found:
            raise ValueError(
                f"model.activation_checkpointing: pattern {pattern!r} matches no module of "
                f"{model_name}; module names look like {', '.join(_examples(model))} "
                "(fnmatch patterns: * matches dots too, e.g. 'blocks.*' or 'layers.?')"
            )
        chosen.update(found)
    outermost = [n for n in chosen if not any(n.startswith(other + ".") for other in chosen)]
    order = {name: i for i, name in enumerate(names.values())}
    return [(n, chosen[n]) for n in sorted(outermost, key=order.__getitem__)]


def _examples(model: nn.Module, limit: int = 6) -> list[str]:
    """A few module names, shallowest first, for error messages."""
    names = sorted(
        (n for n, _ in model.named_modules() if n), key=lambda n: n.count(".")
    )  # stable: model order
    return names[:limit] or ["(the model has no submodules)"]


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The instance ``forward`` of a checkpointed module: its class's forward through ``checkpoint``."""
    forward = type(self).forward.__get__(self)
    if self.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)  # evaluation and no_grad keep nothing: nothing to save


def checkpoint_module(module: nn.Module) -> None:
    """Make ``module`` recompute its activations in backward (non-reentrant). Idempotent."""
    # A bound method (not a closure) so that copy.deepcopy binds it to the copy.
    module.forward = types.MethodType(_checkpointed_forward, module)


def is_checkpointed(module: nn.Module) -> bool:
    """Whether :func:`checkpoint_module` (or a Hugging Face layer's own flag) checkpoints ``module``."""
    forward = module.__dict__.get("forward")
    ours = isinstance(forward, types.MethodType) and forward.__func__ is _checkpointed_forward
    return ours or getattr(module, "gradient_checkpointing", False) is True


def apply_activation_checkpointing(model: nn.Module, spec: Checkpointing | str | list[str]) -> list[str]:
    """Checkpoint ``spec``'s modules of ``model`` in place; returns their names.

    ``spec``: ``"none"``/None, ``"blocks"`` (the transformer blocks: a Hugging Face model's decoder
    layers, else the children of the largest ``nn.ModuleList``) or module-name patterns. Call it
    on the plain model, before any engine wraps it (``Trainer(activation_checkpointing=...)`` does).
    Raises ValueError for a setting that selects nothing.
    """
    spec = parse_checkpointing(spec)
    if spec is None:
        return []
    enable = _hf_checkpointing(model) if spec == "blocks" else None
    if enable is not None:
        kwargs = {"use_reentrant": False}
        if enable.__name__ == "activation_checkpointing_enable":
            enable(activation_checkpointing_kwargs=kwargs)
        else:  # transformers < 5
            enable(gradient_checkpointing_kwargs=kwargs)
        layers = [
            n
            for n, m in model.named_modules()
            if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)
        ]
        return layers or [n for n, m in model.named_modules() if is_checkpointed(m)]
    chosen = select_modules(model, spec)
    for _, module in chosen:
        checkpoint_module(module)
    return [name for name, _ in chosen]


def reentrant_modules(model: nn.Module) -> list[str]:
    """Names of modules that checkpoint with the reentrant variant: Hugging Face layers enabled with
    ``use_reentrant`` not False (torch's default is True), torch ``checkpoint_wrapper`` in REENTRANT mode."""
    found = []
    for name, module in model.named_modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        hf = getattr(module, "gradient_checkpointing", False) is True and func is not None
        if hf and getattr(func, "keywords", {}).get("use_reentrant", True) is not False:
            found.append(name)
        elif getattr(getattr(module, "checkpoint_impl", None), "name", None) == "REENTRANT":
            found.append(name)
    # Hugging Face flags a model's layer stack as well as its layers: name the layers (innermost).
    inner = [n for n in found if not any(o.startswith(n + ".") or (not n and o) for o in found)]
    return [n or "(root)" for n in inner]


def check_engine_compatible(model: nn.Module, engine: str) -> None:
    """Refuse reentrant checkpointing on engines it breaks (``reentrant_checkpointing_safe`` False on the
    engine class: DDP and Accelerate, whose DDP hooks break); ValueError naming the modules and the fix."""
    if engine_class(engine).reentrant_checkpointing_safe:
        return
    found = reentrant_modules(model)
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise ValueError(
            f"model: {len(found)} module(s) checkpoint activations with the reentrant variant ({shown}); with "
            f"engine={engine} DDP fails with 'Expected to mark a variable ready only once' whenever a parameter "
            "takes part in two reentrant backward passes (pytorch#121594). Let distaccum checkpoint instead "
            "(model.activation_checkpointing=blocks, non-reentrant) and do not enable checkpointing in the model "
            "factory, or enable it with use_reentrant=False (Hugging Face: activation_checkpointing_enable("
            "activation_checkpointing_kwargs={'use_reentrant': False}))"
        )


def saved_activation_bytes(model: nn.Module, loss: Callable[[nn.Module, Any], Any], batch: Any) -> int:
    """Bytes autograd keeps for backward after one forward of ``loss(model, batch)`` in training mode:
    the distinct storages saved through ``torch.autograd.graph.saved_tensors_hooks``, parameters
    excluded. Deterministic (no allocator, no timing). Inside a checkpointed region the checkpoint's
    own hooks take over and keep nothing; what it does keep, its inputs, it saves through ours."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return tensor

    was_training = model.training
    model.train()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = loss(model, batch)
        del out  # frees the graph and everything it saved
    finally:
        model.train(was_training)
    return sum(seen.values())
