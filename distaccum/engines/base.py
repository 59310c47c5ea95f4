"""The one engine protocol every backend implements, the precision policy and the step helpers they share.

The training loop talks only to :class:`Engine`; there is no ``if engine == ...`` anywhere else.
Engines receive an :class:`EngineSpec` (what they use, resolved once by :func:`distaccum.resolve.resolve`),
never the whole run configuration. What an engine can do is said on its class (:class:`EngineBase`'s
capability attributes), so no other module tests an engine's name.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Protocol

import torch
from torch import nn

from distaccum.config import EngineConfig, Split

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
        """The policy for ``fp32`` | ``fp64`` | ``bf16`` | ``fp16``."""
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


@dataclass(frozen=True)
class EngineSpec:
    """Everything an engine uses, resolved once at the worker boundary."""

    engine: EngineConfig
    precision: Precision
    split: Split
    sync: str
    """boundary | replica_boundary | every_micro (``accum.sync=auto`` already resolved)."""
    clip_norm: float | None
    device: torch.device
    gns: bool = False
    """Measure the squared gradient norms the noise scale needs (``log.gns``; engines with ``supports_gns``)."""
    compile_mode: str | None = None
    """torch.compile the model with this mode (``trainer.compile``); None: eager."""
    measure_norm: bool = True
    """Measure the gradient norm every step (``log.grad_norm``, or clipping needs it)."""
    replicas: int = 1
    """Model replicas (``engine.replicas``, ``auto`` already resolved): > 1 is HSDP, each replica sharded
    over ``world / replicas`` ranks."""
    reduce_dtype: str = "fp32"
    """fp32 (uncompressed: the gradients' own dtype) | bf16 | fp16: the dtype gradients are reduced in."""

    @property
    def compressed_dtype(self) -> torch.dtype | None:
        """The reduced dtype gradients travel in, or None when the reduction is uncompressed."""
        return REDUCE_DTYPES[self.reduce_dtype]


REDUCE_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``accum.reduce_dtype`` -> the dtype on the wire (None: the gradients' own dtype, no cast)."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did."""

    grad_norm: float | None
    """Global L2 norm of the normalized gradient, before clipping (inf/nan when non-finite; None when not
    measured: ``log.grad_norm=false`` without clipping)."""
    applied: bool
    """False when the step was skipped (fp16 overflow or a non-finite gradient)."""
    nonfinite_param: str | None = None
    """On a skipped step: the first parameter whose (local) gradient is not finite, when known."""


class Engine(Protocol):
    """What the loop needs from a distributed engine. One implementation per engine.

    ``grad_divisor`` states how the engine itself scales the summed gradient: the loop multiplies
    each micro-batch loss by it so that, after the engine's own division, the accumulated gradient
    is exactly the sum of the micro-batch losses' gradients (times the loop's power-of-two c).
    """

    name: str
    grad_divisor: float
    replicated_gradients: bool
    """Every rank holds the whole reduced gradient (:attr:`EngineBase.replicated_gradients`)."""
    optimizer: torch.optim.Optimizer
    grad_squares: Any
    """The noise-scale terms its comm hook measured this step (:class:`~distaccum.telemetry.gns.GradSquares`),
    or None (``log.gns`` off, or an engine without ``supports_gns``)."""

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
        """Backward of one micro-batch's loss (already multiplied by ``grad_divisor`` and c)."""
        ...

    def fold_normalization(self, scale: Callable[[], torch.Tensor]) -> bool:
        """Offer the window's normalization before its boundary backward: an engine that can apply
        ``scale()`` (the 1/(c N), agreed by every rank) inside the boundary reduction itself, on each
        bucket as it is reduced, says True, and its :meth:`step` then skips the separate multiply."""
        ...

    def normalize_loss(self, scale: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """Offer the window's normalization before the backward of its only micro-batch (K = 1): an engine that
        can then reduce the gradient as a plain sum returns what the loss is multiplied by besides the loop's c
        and the micro-batch's weight (``scale()``, the 1/(c N) agreed by every rank, times whatever its own
        backward divides by), and neither its reduction nor its :meth:`step` touches the gradient again. None:
        not offered (the loop then offers :meth:`fold_normalization`)."""
        ...

    def step(self, max_norm: float | None, grad_scale: torch.Tensor, loss_finite: bool | None = None) -> StepResult:
        """Multiply the reduced gradients by ``grad_scale`` (the window's 1/(c N)), clip the global
        norm to ``max_norm`` when set, step the optimizer and zero the gradients. Skips the update
        (and says so) when the gradient is not finite. Called once per optimizer step. ``loss_finite``: the
        loop's verdict on the window's loss, read from its totals (``grad_scale`` is NaN exactly when it is
        False), so an engine that measures no norm need not read ``grad_scale`` on the host (None: read it)."""
        ...

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter, unsharded, in a stable order. Collective: all ranks must iterate."""
        ...

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The plain model's state dict (parameters and buffers), unsharded, on the CPU, under the
        unwrapped model's names. Collective; complete on rank 0 (other ranks may get an empty dict)."""
        ...

    def unwrapped(self) -> nn.Module:
        """The user's module inside the wrapper (its parameters may be sharded)."""
        ...

    def save_state(self, directory: Path) -> dict[str, Any]:
        """Write model and optimizer state into ``directory``, every rank its own part (collective);
        return small JSON-able extras (e.g. the loss scaler) for the trainer state."""
        ...

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        """Restore what :meth:`save_state` wrote, resharding onto this world size where the engine can."""
        ...

    def teardown(self) -> None:
        """Release engine resources (the process group is destroyed by whoever created it)."""
        ...

    def layout(self) -> list[list[int]] | None:
        """HSDP: the ranks of each replica (its shard group), replica by replica; None for other layouts."""
        ...


class EngineBase:
    """What every engine class declares about itself (capabilities), and the defaults they share.

    Capabilities are read off the class before any engine exists (pre-flight, fingerprints), so they
    are class attributes, never tests of ``name``.
    """

    name: ClassVar[str] = "?"
    supports_gns: ClassVar[bool] = False
    """Its gradient comm hook can measure the gradient noise scale's terms (``log.gns``)."""
    reentrant_checkpointing_safe: ClassVar[bool] = True
    """Reentrant activation checkpointing (``use_reentrant=True``) trains correctly under it."""
    reshardable_checkpoints: ClassVar[bool] = True
    """Its checkpoints (DCP) load on another world size; False ties them to the world that wrote them."""
    replicated_gradients: ClassVar[bool] = False
    """After the boundary reduction every rank holds the whole reduced gradient on its parameters' ``.grad``
    (bitwise identical everywhere), so the reduction fingerprint can compare it; sharded engines hold
    each reduced shard once."""
    hybrid_sharding: ClassVar[bool] = False
    """It shards within replicas and replicates across them (``engine.replicas`` > 1, HSDP), which gives
    ``accum.sync=replica_boundary`` its meaning."""
    reduce_dtypes: ClassVar[tuple[str, ...]] = ("fp32",)
    """The ``accum.reduce_dtype`` values it can reduce gradients in."""
    grad_squares: Any = None

    def __init__(self, spec: EngineSpec, ledger: Any) -> None:
        """Refuse what the engine cannot run (:meth:`check`), then keep what every engine uses."""
        self.check(spec)
        self.spec = spec
        self.device = spec.device
        self.ledger = ledger
        """The :class:`~distaccum.telemetry.ledger.CommLedger` its gradient collectives report to."""
        self.precision = spec.precision

    @classmethod
    def check(cls, spec: EngineSpec) -> None:
        """Raise ValueError for what this engine cannot run (called before any worker starts).

        Here: what the capabilities above refuse. Engines that refuse more call this first."""
        if spec.replicas > 1 and not cls.hybrid_sharding:
            raise ValueError(f"engine.replicas={spec.replicas} asks for hybrid sharding (HSDP), which engine="
                             f"{cls.name} does not do: it keeps one whole replica per rank. Use engine=fsdp for "
                             "HSDP, or engine.replicas=auto")
        if spec.sync == "replica_boundary" and spec.replicas <= 1:
            why = ("this engine keeps a whole replica on every rank: there is no reduction inside a replica to "
                   "run per micro-batch" if not cls.hybrid_sharding else
                   f"with engine.replicas={spec.replicas} the mesh is flat (one replica over all ranks): there is "
                   "no cross-replica all-reduce to defer")
            raise ValueError(f"accum.sync=replica_boundary with engine={cls.name} has no meaning: {why}. It is a "
                             "mode of FSDP2 hybrid sharding (engine=fsdp engine.replicas=R, R > 1); use "
                             "accum.sync=boundary or every_micro here")
        if spec.reduce_dtype not in cls.reduce_dtypes:
            raise ValueError(f"accum.reduce_dtype={spec.reduce_dtype} is not supported by engine={cls.name} (it "
                             f"reduces gradients in: {', '.join(cls.reduce_dtypes)}); use accum.reduce_dtype=fp32")

    def layout(self) -> list[list[int]] | None:
        """HSDP: the ranks of each replica (its shard group), replica by replica; None for other layouts."""
        return None

    def fold_normalization(self, scale: Callable[[], torch.Tensor]) -> bool:
        """By default the step normalizes (see :meth:`Engine.fold_normalization`)."""
        return False

    def normalize_loss(self, scale: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """By default the step normalizes (see :meth:`Engine.normalize_loss`)."""
        return None

    @classmethod
    def fingerprint(cls, config: EngineConfig) -> dict[str, Any]:
        """Engine settings a checkpoint must agree with to be resumed (beyond the engine's name)."""
        return {}


def scale_and_clip_(grads: list[torch.Tensor], grad_scale: torch.Tensor,
                    max_norm: float | None) -> torch.Tensor:
    """Normalize and clip ``grads`` in place with one norm pass and one multiply; returns the norm.

    ``grads`` are the accumulated (reduced) gradients G; the true gradient is ``grad_scale * G``.
    Its norm is ``grad_scale * |G|`` and the clip coefficient is torch's
    ``min(1, max_norm / (norm + 1e-6))``, so one multiply by ``grad_scale * coef`` both normalizes
    and clips. The norm stays a tensor (no host sync here). Sharded (DTensor) gradients give a
    DTensor norm; callers make it full.
    """
    raw = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros(())
    if hasattr(raw, "full_tensor"):  # DTensor: per-shard norms, one all-reduce for the total
        raw = raw.full_tensor()
    norm = raw.to(torch.float64) * grad_scale.to(raw.device, torch.float64)
    coef = grad_scale.to(raw.device, torch.float64)
    if max_norm is not None:
        coef = coef * torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in locals_:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, group in by_dtype.items():
        torch._foreach_mul_(group, coef.to(dtype))
    return norm


def dcp_save(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Model and optimizer state with ``torch.distributed.checkpoint``: every rank writes its shards
    (FSDP2) or the replicated tensors once (DDP), under the unwrapped model's names. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory))


def dcp_load(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what :func:`dcp_save` wrote into ``model`` and ``optimizer``, resharding to this world
    size. ``get_state_dict`` first materializes an empty optimizer's state (DCP loads into a template
    of the same structure). Reads with ``weights_only=True``. Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def first_nonfinite(named: Iterable[tuple[str, nn.Parameter]]) -> str | None:
    """The first parameter whose local gradient holds a NaN or inf (only called on a skipped step)."""
    for name, param in named:
        grad = param.grad
        if grad is not None:
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if not bool(torch.isfinite(local).all()):
                return name
    return None


def grads_of(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    """The gradients that exist (parameters without one did not take part in the loss)."""
    return [p.grad for p in params if p.grad is not None]


def clip_normalized_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float | None) -> float:
    """For gradients already normalized (the reduction applied 1/(c N)) whose ``norm`` the reduction
    measured: the clip multiply, only when clipping changes something (no pass over the gradients
    otherwise). Returns the norm read on the host: the one read, which the step needs anyway (on CUDA a
    second ``float`` of the same tensor would be a second device sync)."""
    norm = norm.to(torch.float64)
    value = float(norm)
    if max_norm is not None and value > max_norm:
        coef = max_norm / (norm + 1e-6)
        for dtype in {g.dtype for g in grads}:
            torch._foreach_mul_([g for g in grads if g.dtype == dtype], coef.to(dtype))
    return value


def step_plain(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], max_norm: float | None,
               grad_scale: torch.Tensor, scaler: torch.amp.GradScaler | None, *,
               grads_to_none: bool = True, normalized: bool = False,
               normalized_norm: torch.Tensor | None = None, loss_finite: bool | None = None) -> StepResult:
    """Normalize, clip and step the gradients of ``named`` parameters (whole, or DTensor shards for FSDP2).

    With fp16 the GradScaler unscales first (once per step) and skips the update on overflow;
    otherwise a non-finite norm skips it. Reading the norm is this function's one host sync (the
    update is conditional on it); fp16 adds GradScaler's three (found-inf, the scale before and after).
    ``grads_to_none=False`` zeroes the gradients in place instead of dropping them: needed when they
    are views into DDP's buckets (see :meth:`distaccum.engines.ddp.DDPEngine.wrap`). Sharded (DTensor)
    gradients: per-shard norms and one all-reduce for the total; the multiply acts on the local shards.
    ``normalized``: the gradients are already normalized (the reduction folded ``grad_scale`` in:
    :meth:`Engine.fold_normalization`) and ``normalized_norm`` is their norm as the reduction measured it,
    or None when nothing needs it (no clipping, ``log.grad_norm=false``): then the step is skipped only
    for a non-finite ``grad_scale`` (a non-finite loss), known from ``loss_finite`` when the loop gives it (no host
    read of ``grad_scale``: the step then makes no device sync at all), and the norm is recorded as None.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    grads = grads_of(p for _, p in named)
    if not normalized:
        norm: float | None = float(scale_and_clip_(grads, grad_scale, max_norm))
    elif normalized_norm is not None:
        norm = clip_normalized_(grads, normalized_norm, max_norm)
    else:
        norm = None
    if norm is not None:
        finite = norm == norm and norm != float("inf")  # the one read
    else:
        finite = math.isfinite(float(grad_scale)) if loss_finite is None else loss_finite
    if scaler is not None:
        before = scaler.get_scale()
        scaler.step(optimizer)  # skips the update when unscale_ found inf/nan
        scaler.update()
        applied = scaler.get_scale() >= before
    elif finite:
        optimizer.step()
        applied = True
    else:
        applied = False
    culprit = None if applied else first_nonfinite(named)
    optimizer.zero_grad(set_to_none=grads_to_none)
    return StepResult(norm, applied, culprit)
