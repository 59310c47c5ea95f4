"""What the replicated engines (DDP, and Accelerate, which drives DDP) share: the counting comm hook
and whole-parameter state on every rank.

Each rank holds every parameter and every (reduced) gradient, so the step, the full parameters, the
state dict and the checkpoint are the same code for both; only wrapping and sync control differ.
"""

# No ``from __future__ import annotations`` here: DDP inspects the comm hook's real annotations. The callbacks
# defined inside the hooks quote theirs: unquoted, subscripting ``Future`` ran through typing on every call.

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.engines.base import EngineBase, EngineSpec, StepResult, dcp_load, dcp_save, step_plain
from distaccum.telemetry.gns import GradSquares
from distaccum.telemetry.ledger import CommLedger


@dataclass
class HookState:
    """State of the gradient comm hook: the ledger it reports to, and the noise-scale terms."""

    ledger: CommLedger
    squares: GradSquares | None = None
    """When set (``log.gns``), the bucket's squared norm before and after the reduction."""
    dtype: torch.dtype | None = None
    """The dtype :func:`compressed_allreduce_hook` reduces in (``accum.reduce_dtype``)."""
    fold: Callable[[], torch.Tensor] | None = None
    """Set for a window's boundary reduction (:meth:`ReplicatedEngine.fold_normalization`): the window's
    normalization 1/(c N), applied to each bucket as its all-reduce lands, with the division by the world size
    (:func:`normalize_`)."""
    factor: torch.Tensor | None = None
    """1/(c N), computed from ``fold`` when the window's first bucket lands (:func:`window_scale`)."""
    bucket_factors: dict[torch.dtype, torch.Tensor | float] = field(default_factory=dict)
    """1/(c N W) per bucket dtype, computed once per window (:func:`normalize_`)."""
    buffers: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)
    """Where :func:`normalize_` writes :attr:`bucket_factors` on an accelerator, one per gradient dtype, allocated by
    :meth:`ReplicatedEngine.fold_normalization` on the loop's stream: the comm hook's continuation runs on a stream
    from the pool, and allocating there caches a block per pool stream (a ``cudaMalloc`` each, the first 32 steps)."""
    ready: Any = None
    """On CUDA, the event recorded after a continuation computed the window's scale or a bucket factor, or None (none
    yet this window): the next bucket's continuation waits for it (:func:`await_window`)."""
    event: Any = None
    """The CUDA event :attr:`ready` names, made once and recorded again each time."""
    summed: bool = False
    """Set for the boundary reduction of a window of one micro-batch whose loss carried the normalization
    (:meth:`ReplicatedEngine.normalize_loss`): the buckets are all-reduced as they are, a plain sum, with no
    pass over them before or after."""
    measure: bool = True
    """Measure the reduced gradients' norms (``EngineSpec.measure_norm``)."""
    group: Any = None
    """The DDP module's process group, which the hooks ask for each bucket's all-reduce itself
    (``ProcessGroup.allreduce``: ``dist.all_reduce`` checks its arguments in Python first, on every call)."""
    norms: dict[int, torch.Tensor] = field(default_factory=dict)
    """id(parameter) -> the norm of its normalized, reduced gradient, measured by the hook (the step's
    gradient norm, combined in parameter order whatever the buckets: bitwise what a pass over the
    gradients gives, also after DDP rebuilds its buckets)."""


def await_window(state: HookState) -> None:
    """Make this continuation's stream wait for what an earlier bucket's continuation computed for the window (its
    scale and factors). On CUDA each bucket's continuation runs on a stream of its own from PyTorch's pool, which
    waits for that bucket's all-reduce only, not for another continuation's stream."""
    if state.ready is not None:
        torch.cuda.current_stream().wait_event(state.ready)


def window_computed(state: HookState, on: torch.Tensor) -> None:
    """After this continuation computed something for the window on ``on``'s device: on CUDA, record the event the
    later buckets' continuations wait for (:func:`await_window`)."""
    if on.is_cuda:
        if state.event is None:
            state.event = torch.cuda.Event()
        state.event.record()  # a wait already queued keeps the record it saw
        state.ready = state.event


def window_scale(state: HookState) -> torch.Tensor:
    """The window's 1/(c N) (float64), from the window's collective, computed once per window."""
    if state.factor is None:
        assert state.fold is not None
        state.factor = state.fold().to(torch.float64)
    return state.factor


def bucket_factor(factor: torch.Tensor, world: int, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor | float:
    """1/(c N W) for a bucket of ``dtype``, from the window's float64 1/(c N): in float64, then rounded to the bucket's
    dtype. For a float32 or float64 bucket on the CPU a Python float: ``mul_`` rounds it to the bucket's dtype as
    ``.to(dtype)`` does, without two operations on a one-number tensor per bucket; otherwise a one-number tensor of
    the bucket's dtype (a bf16 bucket multiplies by a Python number in float32, not rounded to bf16), written into
    ``out`` when given (one operation: the float64 division, rounded as it is stored)."""
    if factor.device.type == "cpu" and dtype in (torch.float32, torch.float64):
        return factor.item() / world  # the float64 division the tensor makes
    if out is not None:
        return torch.div(factor, world, out=out)
    return (factor / world).to(dtype)


def normalize_(state: HookState, reduced: torch.Tensor) -> None:
    """After a bucket's all-reduce on a folded boundary reduction (the ranks' sum was reduced as it is):
    multiply it by 1/(c N W), in place, so the step needs no pass of its own to normalize (and, through
    :func:`measure_`, none to measure the norm). After, not before, the reduction: N comes from the window's
    collective, launched before the last backward and queued ahead of every bucket, so it has
    landed by now and nothing waits for it inside the backward (multiplying before the reduction, the
    backward stopped at its first bucket until the slower rank had finished its forward)."""
    if state.fold is not None:
        await_window(state)
        factor = state.bucket_factors.get(reduced.dtype)
        if factor is None:  # the window's first bucket of this dtype (two computing it at once agree)
            scale = window_scale(state)
            factor = bucket_factor(scale, dist.get_world_size(), reduced.dtype, state.buffers.get(reduced.dtype))
            state.bucket_factors[reduced.dtype] = factor
            window_computed(state, scale)
        reduced.mul_(factor)


def measure_(state: HookState, bucket: dist.GradBucket) -> None:
    """Record the norm of each reduced gradient of ``bucket`` (on a folded or summed boundary reduction whose norm
    is wanted: ``state.measure``)."""
    if (state.fold is not None or state.summed) and state.measure:
        for param, norm in zip(bucket.parameters(), torch._foreach_norm(bucket.gradients()), strict=True):
            state.norms[id(param)] = norm


def mean_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce a gradient bucket to the mean over ranks, counting every call and byte.

    Why the mean and not the sum: with ``accum.sync=every_micro`` the bucket holds the already
    reduced gradient of earlier micro-batches plus this rank's new contribution. The mean of
    identical values is that value, so only the new part is averaged; a sum would multiply the
    earlier part by the world size. The loop compensates the 1/world with ``grad_divisor``.
    """
    buffer = bucket.buffer()
    if state.squares is not None:  # this rank's accumulated gradient, before the reduction overwrites it
        state.squares.add_local(buffer)
    token = state.ledger.launched(buffer)
    if state.fold is None and not state.summed:  # the mean; a folded one is normalized when it lands (normalize_)
        buffer.div_(dist.get_world_size())
    future = state.group.allreduce([buffer]).get_future()  # a sum

    def done(fut: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        state.ledger.completed(token)
        reduced = fut.value()[0]
        normalize_(state, reduced)
        if state.squares is not None:
            state.squares.add_reduced(reduced)
        measure_(state, bucket)
        return reduced

    return future.then(done)


def compressed_allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """:func:`mean_allreduce_hook` with the bucket all-reduced in ``state.dtype`` (bf16/fp16): half the bytes.

    The bucket is divided by the world size in its own dtype, cast (the one rounding of this rank's
    accumulated gradient), all-reduced in the low dtype and copied back into the bucket, so the
    gradients stay in the parameters' dtype between reductions. PyTorch's ``bf16_compress_hook`` does
    the same but refuses gloo; this one also counts the compressed bytes in the ledger.
    """
    buffer = bucket.buffer()
    if state.squares is not None:
        state.squares.add_local(buffer)
    assert state.dtype is not None
    # Divide first (fp16 must not overflow), unless the loss carried the normalization (a summed reduction).
    compressed = (buffer if state.summed else buffer.div_(dist.get_world_size())).to(state.dtype)
    token = state.ledger.launched(compressed)
    future = state.group.allreduce([compressed]).get_future()  # a sum

    def done(fut: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        state.ledger.completed(token)
        if state.fold is None:
            buffer.copy_(fut.value()[0])
        else:  # back into the bucket and normalized by 1/(c N) in one pass, in the bucket's dtype
            await_window(state)
            first = state.factor is None
            scale = window_scale(state)
            if first:
                window_computed(state, scale)
            torch.mul(fut.value()[0], scale.to(buffer.dtype).reshape(1), out=buffer)
        if state.squares is not None:
            state.squares.add_reduced(buffer)
        measure_(state, bucket)
        return buffer

    return future.then(done)


CommHook = Callable[[HookState, dist.GradBucket], torch.futures.Future[torch.Tensor]]


class ReplicatedEngine(EngineBase):
    """Base of the engines that keep whole parameters on every rank behind a DDP module.

    Subclasses set ``raw`` (the plain model), ``optimizer`` and ``scaler`` in ``wrap`` and install
    :attr:`comm_hook` on their DDP module with :meth:`register_hook`.
    """

    comm_hook: ClassVar[CommHook] = staticmethod(mean_allreduce_hook)  # type: ignore[assignment]
    """The gradient comm hook installed on the DDP module: DDP takes exactly one, so anything that wants
    to see or change the reduction (the ledger, the noise scale, a test's fault) goes through it. With
    ``accum.reduce_dtype`` bf16/fp16 the engine holds :func:`compressed_allreduce_hook` instead."""
    reduce_dtypes = ("fp32", "bf16", "fp16")
    replicated_gradients = True  # every rank's .grad holds the whole all-reduced gradient
    grads_to_none: ClassVar[bool] = True
    """Drop gradients after the step (True) or zero them in place (False: they are bucket views)."""
    raw: nn.Module | None = None
    _named_parameters: list[tuple[str, nn.Parameter]] | None = None
    _gradient_bytes: int | None = None
    _gradient_dtypes: set[torch.dtype] | None = None
    optimizer: torch.optim.Optimizer
    scaler: "torch.amp.GradScaler | None" = None
    ledger: CommLedger

    def __init__(self, spec: EngineSpec, ledger: CommLedger) -> None:
        super().__init__(spec, ledger)
        if spec.compressed_dtype is not None:  # on the instance: what register_hook installs, faults wrap
            self.comm_hook = compressed_allreduce_hook  # type: ignore[misc]

    def register_hook(self, ddp: DDP) -> None:
        """Install :attr:`comm_hook` on ``ddp``, reporting to the ledger (and the noise scale)."""
        self.hook_state = HookState(self.ledger, self.grad_squares, self.spec.compressed_dtype,
                                    measure=self.spec.measure_norm, group=ddp.process_group)
        ddp.register_comm_hook(self.hook_state, self.comm_hook)

    def _normalizing_hook(self) -> HookState | None:
        """The hook's state where the boundary reduction may take over the window's normalization (folded in,
        or carried by the loss). Not with ``every_micro`` (earlier reductions carry no normalization), the noise
        scale (its terms are read before and after the reduction at the loss's scale) or fp16 (GradScaler
        unscales and checks first)."""
        state = getattr(self, "hook_state", None)
        if state is None or self.spec.sync != "boundary" or self.grad_squares is not None or self.scaler is not None:
            return None
        return state

    def fold_normalization(self, scale: Callable[[], torch.Tensor]) -> bool:
        """Fold the window's 1/(c N) into its one boundary reduction (see :func:`normalize_`), where
        :meth:`_normalizing_hook` allows it."""
        state = self._normalizing_hook()
        if state is None:
            return False
        state.fold, state.factor, state.norms, state.bucket_factors, state.ready = scale, None, {}, {}, None
        if self.spec.device.type != "cpu":
            state.buffers = {dtype: torch.empty((), dtype=dtype, device=self.spec.device) for dtype in self._grad_dtypes()}
        return True

    def normalize_loss(self, scale: Callable[[], torch.Tensor]) -> torch.Tensor | None:
        """On the CPU, for a window of one micro-batch whose gradient holds at least ``engine.normalize_in_loss_mb``
        MiB: all-reduce its gradient as a plain sum of losses already multiplied by 1/(c N), instead of averaging
        it (a pass over every bucket before the all-reduce, as DDP's default does) or normalizing it as it lands
        (the same pass after: :func:`normalize_`). The price is that N's collective, launched after the forward,
        is waited for before the backward starts: worth it where the pass costs more than that wait (a large
        gradient). Only where :meth:`fold_normalization` would fold, and not on an accelerator, where a pass over
        the gradient costs little and the stream would wait for every rank's forward (not measured there)."""
        state, limit = self._normalizing_hook(), self.spec.engine.normalize_in_loss_mb
        if state is None or limit is None or self.spec.device.type != "cpu" or self._grad_bytes() < limit * 2**20:
            return None
        state.fold, state.factor, state.norms, state.summed = None, None, {}, True
        return scale() * (self.grad_divisor / dist.get_world_size())  # what the backward divides by: K (Accelerate)

    def _raw(self) -> nn.Module:
        assert self.raw is not None, "wrap() first"
        return self.raw

    def _grad_dtypes(self) -> set[torch.dtype]:
        """The dtypes of the gradient buckets (the trainable parameters')."""
        if self._gradient_dtypes is None:
            self._gradient_dtypes = {p.dtype for _, p in self._named() if p.requires_grad}
        return self._gradient_dtypes

    def _grad_bytes(self) -> int:
        """Bytes of the gradient the reduction carries (the trainable parameters; counted once)."""
        if self._gradient_bytes is None:
            self._gradient_bytes = sum(p.numel() * p.element_size() for _, p in self._named() if p.requires_grad)
        return self._gradient_bytes

    def _named(self) -> list[tuple[str, nn.Parameter]]:
        """The plain model's named parameters, listed once: whole parameters stay the same objects for the whole
        run, and walking the module tree every step cost 0.45 ms on a GPT-2-shaped model (164 modules)."""
        if self._named_parameters is None:
            self._named_parameters = list(self._raw().named_parameters())
        return self._named_parameters

    def step(self, max_norm: float | None, grad_scale: torch.Tensor, loss_finite: bool | None = None) -> StepResult:
        named = self._named()
        state = getattr(self, "hook_state", None)
        norm, folded = None, state is not None and (state.summed or state.fold is not None and state.factor is not None)
        if folded and state.measure:  # type: ignore[union-attr]  # the reduction normalized and measured
            parts = [state.norms.get(id(p)) for _, p in named if p.grad is not None]  # type: ignore[union-attr]
            if any(part is None for part in parts):  # summed, and no reduction ran (a fault): measure here
                parts = list(torch._foreach_norm([p.grad for _, p in named if p.grad is not None]))
            norm = torch.linalg.vector_norm(torch.stack(parts)) if parts else torch.zeros((), dtype=torch.float64)
        if state is not None:
            state.fold, state.factor, state.norms, state.summed, state.bucket_factors = None, None, {}, False, {}
            state.ready = None
        return step_plain(self.optimizer, named, max_norm, grad_scale, self.scaler, grads_to_none=self.grads_to_none,
                          normalized=folded, normalized_norm=norm, loss_finite=loss_finite)

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self._raw().named_parameters():
            yield name, param.detach()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self._raw().state_dict().items()}

    def unwrapped(self) -> nn.Module:
        return self._raw()

    def save_state(self, directory: Path) -> dict[str, Any]:
        dcp_save(directory, self._raw(), self.optimizer)  # replicated: written once, loadable on any world size
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        dcp_load(directory, self._raw(), self.optimizer)
        if self.scaler is not None and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
