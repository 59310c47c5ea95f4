"""The one engine protocol every backend implements, the precision policy and the step helpers they share.

The training loop talks only to :class:`Engine`; there is no ``if engine == ...`` anywhere else.
Engines receive an :class:`EngineSpec` (what they use, resolved once by :func:`distaccum.resolve.resolve`),
never the whole run configuration. What an engine can do is said on its class (:class:`EngineBase`'s
capability attributes), so no other module tests an engine's name.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Protocol

import torch
from torch import nn

from distaccum.config import EngineConfig, Split
from distaccum.guards.checksum import SAMPLE

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
    sample_grads: bool = False
    """Check the reduction every step (the reduction fingerprint, ``trainer.fingerprint`` with more than one rank):
    engines whose ranks each hold the whole reduced gradient take :class:`GradSample` of it, sharded engines their
    :class:`~distaccum.guards.checksum.ReductionChecksum`."""

    exact: bool = False
    """``accum.exact``: the gradients are summed in int64 fixed point (:mod:`distaccum.exact`), which drives this
    engine with every micro-batch under its ``no_sync``."""

    islands: Any = None
    """An outer-synced run (``outer.method``): its :class:`~distaccum.outer.islands.Islands`. The engine's world is
    then this rank's island (its process group, its mesh), never the whole run; None: the whole world."""

    @property
    def group(self) -> Any:
        """The process group the engine reduces over: the island's (outer-synced runs), else None (the world)."""
        return self.islands.inner_group if self.islands is not None else None

    @property
    def world_size(self) -> int:
        """Ranks the engine spans: the island's (outer-synced runs), else the whole world."""
        return self.islands.layout.size if self.islands is not None else self.split.world_size

    def state_dir(self, directory: Path) -> Path:
        """Where this rank's engine state goes in a checkpoint: ``directory``, or its island's sub-directory (the
        islands' parameters and inner optimizers differ between syncs). A checkpoint written before islands were
        called islands holds ``replica-N`` instead: read there when only that one exists."""
        if self.islands is None:
            return directory
        island, old = (directory / f"{name}-{self.islands.layout.index}" for name in ("island", "replica"))
        return old if not island.exists() and old.is_dir() else island

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
    measured: no clipping, ``log.grad_norm=false`` and no reduction fingerprint)."""
    applied: bool
    """False when the step was skipped (fp16 overflow or a non-finite gradient)."""
    nonfinite_param: str | None = None
    """On a skipped step: the first parameter whose (local) gradient is not finite, when known."""
    grad_sample: torch.Tensor | None = None
    """Where asked for (``EngineSpec.sample_grads``): :class:`GradSample`'s two numbers of the reduced gradient,
    before the normalization (float64, on the device): bitwise the same on every rank after a correct reduction (the
    reduction fingerprint compares them)."""
    grad_sums: torch.Tensor | None = None
    """Sharded engines, where asked for: the reduction checksum's [a, m, b] of this rank
    (:class:`~distaccum.guards.checksum.ReductionChecksum`; float64, on the device)."""
    redo: bool = False
    """Nothing was applied and the window must run again (``accum.exact``: a piece's gradient did not fit the fixed-point
    scale, which is now wider; the same on every rank)."""


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

    def step(self, max_norm: float | None, grad_scale: float) -> StepResult:
        """Multiply the reduced gradients by ``grad_scale`` (the window's 1/(c N): the normalization, applied here
        and nowhere else), clip the global norm to ``max_norm`` when set, step the optimizer and zero the
        gradients. Skips the update (and says so) when the gradient is not finite (``grad_scale`` is NaN when a
        rank's loss was). Called once per optimizer step."""
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

    def reduction_rounds(self, accum_steps: int | None = None) -> tuple[int, int] | None:
        """The micro-batches of a window of ``accum_steps`` (default: the split's K) that reduce gradients
        (in-replica, cross-replica); None: no promise (:meth:`EngineBase.reduction_rounds`)."""
        ...


class EngineBase:
    """What every engine class declares about itself (capabilities), and the defaults they share.

    Capabilities are read off the class before any engine exists (pre-flight, run identities), so they
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
    worker_imports: ClassVar[tuple[str, ...]] = ()
    """Modules its workers import before their first step beyond the Trainer's own: a local launch's worker server
    loads them once for every forked worker (:mod:`distaccum.cluster.forked`)."""
    exact_accumulation: ClassVar[bool] = False
    """``accum.exact`` can drive it: its ``sync(False)`` leaves every micro-batch's whole local gradient on the
    ``.grad`` of ``local_gradients()`` without any reduction, and its ``step`` takes the gradients as they are then:
    the parameters' own (``replicated_gradients``), or the shards ``gradient_shards()`` returns (sharded engines)."""
    ft_refusal: ClassVar[str | None] = None
    """Why it cannot train in fault-tolerant replica groups (``ft.groups``); None: it can (its gradients and its
    plain state dict are the group's, which torchft sums across groups and copies to a healing one)."""
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
            raise ValueError(
                f"engine.replicas={spec.replicas} asks for hybrid sharding (HSDP), which engine="
                f"{cls.name} does not do: it keeps one whole replica per rank. Use engine=fsdp for "
                "HSDP, or engine.replicas=auto"
            )
        if spec.sync == "replica_boundary" and spec.replicas <= 1:
            why = (
                "this engine keeps a whole replica on every rank: there is no reduction inside a replica to "
                "run per micro-batch"
                if not cls.hybrid_sharding
                else f"with engine.replicas={spec.replicas} the mesh is flat (one replica over all ranks): there is "
                "no cross-replica all-reduce to defer"
            )
            raise ValueError(
                f"accum.sync=replica_boundary with engine={cls.name} has no meaning: {why}. It is a "
                "mode of FSDP2 hybrid sharding (engine=fsdp engine.replicas=R, R > 1); use "
                "accum.sync=boundary or every_micro here"
            )
        if spec.reduce_dtype not in cls.reduce_dtypes:
            raise ValueError(
                f"accum.reduce_dtype={spec.reduce_dtype} is not supported by engine={cls.name} (it "
                f"reduces gradients in: {', '.join(cls.reduce_dtypes)}); use accum.reduce_dtype=fp32"
            )

    def layout(self) -> list[list[int]] | None:
        """HSDP: the ranks of each replica (its shard group), replica by replica; None for other layouts."""
        return None

    @classmethod
    def identity(cls, config: EngineConfig) -> dict[str, Any]:
        """The engine's part of the run identity: settings a checkpoint must agree with to be resumed (beyond the
        engine's name)."""
        return {}

    def reduction_rounds(self, accum_steps: int | None = None) -> tuple[int, int] | None:
        """The micro-batches of a window of ``accum_steps`` micro-batches (default: the split's K; a growing batch
        changes it between steps) that reduce gradients, as ``accum.sync`` promises them: (in-replica,
        cross-replica). ``boundary``: 1 (and 1 across HSDP replicas); ``every_micro``: K (K); ``replica_boundary``:
        K inside the replica, 1 across; a replica of one rank reduces nothing inside it. The ledger's count must equal
        it every step (:class:`~distaccum.guards.reduction_count.ReductionCount`); None: this engine keeps no such
        promise."""
        k, sync, replicas = accum_steps or self.spec.split.accum_steps, self.spec.sync, self.spec.replicas
        across = (k if sync == "every_micro" else 1) if replicas > 1 else 0
        inner = 0 if self.spec.world_size == replicas else (1 if sync == "boundary" else k)
        return inner, across


class GradNorms:
    """The reduced gradient's global L2 norm, from each tensor's norm in a float64 buffer kept from step to step,
    read on the host once per step (the update depends on it being finite)."""

    def __init__(self) -> None:
        self._out: torch.Tensor | None = None
        self._host: torch.Tensor | None = None
        self._host_np: Any = None
        """A NumPy view of the norms on the host (of ``_out`` on the CPU, of a pinned copy on CUDA)."""

    def measure(self, grads: list[torch.Tensor]) -> float:
        """The global L2 norm of ``grads``. Sharded (DTensor) gradients: per-shard norms and one all-reduce."""
        if not grads:
            return 0.0
        if hasattr(grads[0], "full_tensor"):
            total: Any = torch.nn.utils.get_total_norm(
                grads, foreach=True
            )  # a DTensor: an all-reduce makes it full
            return float(total.full_tensor())
        out = self._out
        if out is None or out.numel() != len(grads) or out.device != grads[0].device:
            out = self._out = torch.empty(len(grads), dtype=torch.float64, device=grads[0].device)
            self._host = torch.empty(len(grads), dtype=torch.float64, pin_memory=True) if out.is_cuda else out
            self._host_np = self._host.numpy()
        torch.stack(torch._foreach_norm(grads), out=out)
        if out.is_cuda:
            assert self._host is not None
            self._host.copy_(out)  # the read the step waits for
        return math.sqrt(math.fsum(x * x for x in self._host_np.tolist()))


RUN = 16
""":class:`GradSample`'s size: about :data:`~distaccum.guards.checksum.SAMPLE` elements, in runs of RUN consecutive
ones (64 bytes of fp32: a cache line)."""


def sample_views(grads: list[torch.Tensor], sample: int = SAMPLE, run: int = RUN) -> list[torch.Tensor]:
    """About ``sample`` elements of the gradients as (rows, ``run``) views: runs of ``run`` consecutive elements evenly
    spaced through each gradient, the first run of every tensor included (a tensor shorter than a run: its first
    element, repeated). Views of contiguous gradients stay valid while the gradients do."""
    stride = max(run, sum(g.numel() for g in grads) * run // sample)
    views = []
    for g in grads:
        flat = g.reshape(-1)
        rows = flat.numel() // stride
        if rows:
            views.append(flat[: rows * stride].view(rows, stride)[:, :run])
        elif flat.numel() >= run:
            views.append(flat[:run].view(1, run))
        else:
            views.append(flat[:1].expand(1, run))
    return views


class GradSample:
    """Two numbers of a fixed sample of the reduced gradient (:func:`sample_views`): its position-weighted sum and its
    sum of squares, in float64 on the gradients' device. A reduced gradient is bitwise the same on every rank after a
    correct all-reduce, so these are too; position weights make two tensors' gradients swapped between ranks show.
    Two operations a step: the sample copied into the second row of a (2, n) buffer kept from step to step, whose
    first row holds the weights, and one matrix-vector product of the buffer with that row. The views are made once
    while the same gradient tensors come back (DDP's bucket views); gradients an engine frees each step get new views
    each step, and none is kept alive through the next backward."""

    def __init__(self) -> None:
        self._seen: list[weakref.ref[torch.Tensor]] = []
        self._views: list[torch.Tensor] | None = None
        self._matrix: torch.Tensor | None = None
        self._sample: torch.Tensor | None = None
        """The matrix's second row, the sample (a view made once)."""
        self._rows: torch.Tensor | None = None

    def _views_of(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        same = len(self._seen) == len(grads) and all(r() is g for r, g in zip(self._seen, grads, strict=True))
        if same and self._views is not None:
            return self._views
        views = sample_views(grads)
        self._views = views if same and all(g.is_contiguous() for g in grads) else None  # seen twice: kept
        self._seen = [weakref.ref(g) for g in grads]
        return views

    def take(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """[weighted sum, sum of squares] of the sample of ``grads`` (None without gradients)."""
        if not grads:
            return None
        views = self._views_of(grads)
        n = sum(v.numel() for v in views)
        matrix = self._matrix
        if matrix is None or matrix.shape[1] != n or matrix.device != grads[0].device:
            matrix = self._matrix = torch.empty(2, n, dtype=torch.float64, device=grads[0].device)
            matrix[0] = torch.linspace(1.0, 2.0, n, dtype=torch.float64, device=grads[0].device)
            self._sample = matrix[1]
            self._rows = self._sample.view(-1, RUN)
        assert self._sample is not None and self._rows is not None  # made with the matrix
        torch.cat(views, out=self._rows)  # widened to float64 exactly
        return torch.mv(matrix, self._sample)


def dcp_save(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any = None) -> None:
    """Model and optimizer state with ``torch.distributed.checkpoint``: every rank writes its shards
    (FSDP2) or the replicated tensors once (DDP), under the unwrapped model's names. Collective over ``group``
    (None: the world; an outer-synced run's island, each island into its own directory)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory), process_group=group
    )


def dcp_load(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, group: Any = None) -> None:
    """Load what :func:`dcp_save` wrote into ``model`` and ``optimizer``, resharding to this world
    size. ``get_state_dict`` first materializes an empty optimizer's state (DCP loads into a template
    of the same structure). Reads with ``weights_only=True``. Collective over ``group``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load(
        {"model": model_state, "optimizer": optim_state}, checkpoint_id=str(directory), process_group=group
    )  # loads in place
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)


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


def step_plain(
    optimizer: torch.optim.Optimizer,
    named: list[tuple[str, nn.Parameter]],
    max_norm: float | None,
    grad_scale: float,
    scaler: torch.amp.GradScaler | None,
    *,
    grads_to_none: bool = True,
    norms: GradNorms | None = None,
    sample: GradSample | None = None,
) -> StepResult:
    """Normalize, clip and step the gradients of ``named`` parameters (whole, or DTensor shards for FSDP2).

    The reduced gradient G is multiplied by ``grad_scale`` (the window's 1/(c N)) and, with ``max_norm``, by torch's
    clip coefficient min(1, max_norm / (norm + 1e-6)) in the same multiply: one pass. The norm is the normalized
    gradient's, ``grad_scale`` times G's, measured before the multiply with ``norms`` (None: not measured; the step
    is then skipped only for a non-finite ``grad_scale``, that is a non-finite loss). ``sample`` takes the reduction
    fingerprint's :class:`GradSample` of G before the multiply. With fp16 the GradScaler
    unscales first and skips the update on overflow (three host reads of its own). ``grads_to_none=False`` zeroes
    the gradients in place instead of dropping them: needed when they are views into DDP's buckets (see
    :meth:`distaccum.engines.ddp.DDPEngine.wrap`).
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    grads = grads_of(p for _, p in named)
    taken = sample.take(grads) if sample is not None else None
    norm = norms.measure(grads) * grad_scale if norms is not None else None
    finite = math.isfinite(grad_scale if norm is None else norm)
    coef = grad_scale
    if max_norm is not None and norm is not None and finite:
        coef *= min(1.0, max_norm / (norm + 1e-6))
    if grads and (finite or scaler is not None):
        torch._foreach_mul_([g.to_local() if hasattr(g, "to_local") else g for g in grads], coef)
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
    return StepResult(norm, applied, culprit, taken)
