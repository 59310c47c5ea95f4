"""``accum.micro_batch=auto``: the largest micro-batch whose training step fits the memory budget.

The global batch G is fixed; on W ranks the candidates are the divisors m of G/W (K = G/(W m)).
Each candidate is measured by a *trial window* on a throwaway copy of the run (model, engine and
optimizer built exactly as training builds them, then discarded, so the real run starts untouched):
a micro-batch of m real samples accumulated locally (``engine.sync(False)``; when K > 1), then the
boundary micro-batch with its gradient reduction and one optimizer step, which allocates the
optimizer state. Memory does not grow with K (the accumulated gradient is one buffer), so two
micro-batches stand for a window of any length.
Its peak is what the run's records call ``peak_mem_bytes``: allocated device memory on CUDA, the
process's peak RSS on CPU. On CUDA an out-of-memory error in the local micro-batches counts as
"does not fit" and the search retries smaller; every rank reports whether it fit and the ranks agree
(a size fits only if it fits everywhere), so all ranks walk the same search and pick the same m —
the largest that fits on the tightest rank.

Search (:func:`search`): measure m=1 (it must fit: otherwise the budget is below what one sample
needs, and the error says how much that is), then the next size, extrapolate the peak linearly in
m and try the largest size predicted to fit; a miss bisects between the largest size that fit and
the smallest that did not. Sizes predicted to exceed the budget are never tried, so on CPU a trial
never drives the machine into swapping or the OOM killer.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, ContextManager, Protocol

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import default_collate

from distaccum.components import Components
from distaccum.config import ConfigError
from distaccum.data.global_batch import GlobalBatchOrder
from distaccum.data.pipeline import to_device
from distaccum.engines import make_engine
from distaccum.engines.base import Precision, StepResult
from distaccum.losses import LossFn
from distaccum.resolve import ResolvedRun
from distaccum.runtime.procgroup import collective_device
from distaccum.split import Split
from distaccum.telemetry.ledger import CommLedger
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory
from distaccum.units import human_bytes

CPU_RAM_FRACTION = 0.8
"""Default CPU budget: this share of the available RAM, divided among the node's ranks."""
TRIAL_MICRO_BATCHES = 2
"""Micro-batches per trial window: one accumulated locally, one with the boundary reduction."""


@dataclass
class Measurement:
    """One measured micro-batch size."""

    micro_batch: int
    peak_bytes: int
    """Largest peak over the ranks (0 when a rank ran out of memory before it could be read)."""
    fits: bool
    """The peak is within the budget on every rank and no rank ran out of memory."""
    oom: bool = False
    """A rank raised an out-of-memory error (CUDA)."""
    measured: bool = True
    """False: not run (``distaccum plan`` extrapolates sizes predicted not to fit instead of trying them)."""


@dataclass
class AutoChoice:
    """What ``micro_batch=auto`` chose, and the measurements behind it (recorded in summary.json)."""

    micro_batch: int
    accum_steps: int
    peak_bytes: int
    """Measured peak of a trial window at the chosen size (largest over the ranks)."""
    budget_bytes: int
    """The smallest budget over the ranks."""
    memory: str
    """What the peak measures: 'cuda allocated' or 'cpu peak rss'."""
    probes: list[Measurement] = field(default_factory=list)

    def as_record(self) -> dict[str, Any]:
        """The ``auto_micro_batch`` entry of ``summary.json``."""
        return asdict(self)

    def describe(self) -> str:
        """One console line."""
        tried = ", ".join(
            f"{p.micro_batch}: {'OOM' if p.oom else human_bytes(p.peak_bytes)}{'' if p.fits else ' (over)'}"
            for p in self.probes
        )
        return (
            f"accum.micro_batch=auto -> {self.micro_batch} (accum steps {self.accum_steps}): trial peak "
            f"{human_bytes(self.peak_bytes)} of a {human_bytes(self.budget_bytes)} budget per rank "
            f"({self.memory}); measured micro-batches {tried}"
        )


def micro_batch_sizes(global_batch: int, world_size: int) -> list[int]:
    """Every micro-batch that splits ``global_batch`` on ``world_size`` ranks, ascending."""
    per_rank = global_batch // world_size
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def memory_kind(device: torch.device) -> str:
    """What a peak on ``device`` measures."""
    return "cuda allocated" if device.type == "cuda" else "cpu peak rss"


def default_budget(device: torch.device, local_world_size: int) -> int:
    """The budget when ``accum.memory_budget`` is unset: on CUDA the device's free memory plus what
    this process already holds; on CPU this process's resident memory plus its share of 80% of the
    available RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_allocated(device))
    available = psutil.virtual_memory().available
    return int(psutil.Process().memory_info().rss + CPU_RAM_FRACTION * available / max(local_world_size, 1))


def _agree(value: float, op: Any) -> float:
    """All-reduce one number over the ranks (identity without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor, op=op)
    return float(tensor.item())


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


class Steps(Protocol):
    """The part of the engine protocol a trial window uses (every engine has it)."""

    grad_divisor: float

    def sync(self, enabled: bool) -> ContextManager[object]: ...

    def forward_context(self) -> ContextManager[object]: ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def step(self, max_norm: float | None, grad_scale: float) -> StepResult: ...


class LocalSteps:
    """A plain model and optimizer in one process, behind the :class:`Steps` subset (pre-flight)."""

    grad_divisor = 1.0

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision, device: torch.device) -> None:
        self.optimizer, self.precision, self.device = optimizer, precision, device

    def sync(self, enabled: bool) -> ContextManager[object]:
        return nullcontext()

    def forward_context(self) -> ContextManager[object]:
        return self.precision.autocast(self.device)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, max_norm: float | None, grad_scale: float) -> StepResult:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(0.0, True)


def trial_batches(
    dataset: Any,
    collate: Callable[[list[Any]], Any],
    order: GlobalBatchOrder,
    split: Split,
    rank: int,
    count: int,
) -> list[Any]:
    """This rank's first ``count`` collated micro-batches of the order's first window under ``split``
    (the samples training starts with)."""
    pieces = order.window(0).rank_micro_batches(split, rank)[:count]
    return [collate([dataset[int(i)] for i in piece]) for piece in pieces if len(piece)]


def trial_window(
    steps: Steps,
    model: nn.Module,
    loss_fn: LossFn,
    batches: Sequence[Any],
    device: torch.device,
    float_dtype: torch.dtype | None = None,
    max_norm: float | None = None,
) -> tuple[int, bool]:
    """Run one window of ``batches`` (all but the last accumulated locally, the last with the gradient
    reduction and the optimizer step); returns (peak bytes on this rank, ran out of memory on some rank).

    Collective when a process group exists: the ranks agree after the local micro-batches, so a
    rank that ran out of memory never leaves the others waiting in the reduction.
    """
    _release(device)
    reset_peak_memory(device)
    oom = False

    def micro(batch: Any, boundary: bool) -> None:
        with steps.sync(boundary):
            with steps.forward_context():
                summed, n_items = loss_fn(model, to_device(batch, device, float_dtype))
            scale = steps.grad_divisor / max(float(n_items), 1.0)
            steps.backward(summed * scale)

    try:
        for batch in batches[:-1]:
            micro(batch, False)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not _is_oom(err):
            raise
        oom = True
    oom = _agree(float(oom), dist.ReduceOp.MAX) > 0
    if not oom:
        try:
            micro(batches[-1], True)
            steps.step(max_norm, 1.0)
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not _is_oom(err):
                raise
            oom = True  # after the reduction began: the ranks may disagree (documented)
    peak = peak_memory_bytes(device)
    _release(device)
    return peak, oom


def search(
    sizes: Sequence[int], measure: Callable[[int], Measurement], budget: int
) -> tuple[int | None, list[Measurement]]:
    """The largest size in ``sizes`` (ascending) that fits, and every probe measured on the way.

    None when even the smallest does not fit. ``measure(m)`` must give the same verdict on every
    rank (it agrees over them), so every rank takes the same path.
    """
    probes: dict[int, Measurement] = {}

    def probe(m: int) -> Measurement:
        probes[m] = measure(m)
        return probes[m]

    if not probe(sizes[0]).fits:
        return None, list(probes.values())
    best, above = sizes[0], None  # largest size that fit; smallest that did not
    while True:
        open_ = [m for m in sizes if m > best and (above is None or m < above) and m not in probes]
        if not open_:
            break
        if above is not None:
            candidate = open_[len(open_) // 2]  # bisect between what fit and what did not
        else:
            fitted = sorted((p.micro_batch, p.peak_bytes) for p in probes.values() if p.fits)
            if len(fitted) < 2:
                candidate = open_[0]  # a second point, for the slope
            else:
                (m0, p0), (m1, p1) = fitted[-2], fitted[-1]
                slope = max((p1 - p0) / (m1 - m0), 0.0)
                predicted_fit = [m for m in open_ if p1 + slope * (m - m1) <= budget]
                if not predicted_fit:
                    break  # the next size is predicted not to fit: never tried
                candidate = predicted_fit[-1]
        if probe(candidate).fits:
            best = candidate
        else:
            above = candidate
    return best, sorted(probes.values(), key=lambda p: p.micro_batch)


def budget_too_small(need: int | None, budget: int, device: torch.device) -> ConfigError:
    """The error for a budget below what one sample per micro-batch needs (``need`` None: out of memory)."""
    what = "more than the device holds (out of memory)" if need is None else human_bytes(need)
    default = "the free device memory" if device.type == "cuda" else "the available RAM"
    return ConfigError(
        f"accum.memory_budget={human_bytes(budget)} is below what one sample needs: a training step with "
        f"micro_batch=1 peaks at {what} per rank ({memory_kind(device)}: model, gradients, optimizer state and "
        f"one sample's activations{', the Python process included' if device.type == 'cpu' else ''}). "
        f"Raise accum.memory_budget, leave it unset to use {default}, or use a smaller model or shorter samples"
    )


class TrialMeasure:
    """``measure(m) -> Measurement``: a trial window at micro-batch ``m`` on a throwaway copy of the run
    (model, engine and optimizer built as training builds them: same seed, precision, ``init_from``
    and engine settings; then discarded). Collective; the verdict is agreed over the ranks."""

    def __init__(self, run: ResolvedRun, parts: Components, budget: int) -> None:
        self.run, self.parts, self.device = run, parts, run.device
        self.budget = int(_agree(float(budget), dist.ReduceOp.MIN))
        """The smallest budget over the ranks."""
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.global_batch = run.global_batch
        self.order = run.data.order(parts.dataset, self.global_batch)

    def run_trial(self, split: Split) -> tuple[int, bool]:
        """(peak bytes on this rank, out of memory on some rank) of one trial window of ``split``'s
        micro-batches. The engine is built for a window of that many micro-batches (engines that count
        micro-batches, Accelerate and DeepSpeed, then place the boundary where the trial does); memory
        does not depend on K."""
        parts = self.parts
        count = min(TRIAL_MICRO_BATCHES, split.accum_steps)
        trial = self.run.with_split(Split(split.micro_batch, count, split.world_size))
        engine = make_engine(trial.engine, CommLedger(enabled=False))
        model = trial.model.build(parts)
        wrapped = engine.wrap(model, trial.optimizer(parts))
        try:
            batches = trial_batches(
                parts.dataset, parts.collate or default_collate, self.order, split, self.rank, count
            )
            return trial_window(
                engine,
                wrapped,
                parts.loss,
                batches,
                self.device,
                trial.loop.float_dtype,
                trial.loop.clip_norm,
            )
        finally:
            engine.teardown()
            del wrapped, model, engine
            _release(self.device)

    def __call__(self, micro_batch: int) -> Measurement:
        per_rank = self.global_batch // self.world
        peak, oom = self.run_trial(Split(micro_batch, per_rank // micro_batch, self.world))
        worst = int(_agree(float(peak), dist.ReduceOp.MAX))
        fits = _agree(float(not oom and peak <= self.budget), dist.ReduceOp.MIN) > 0
        return Measurement(micro_batch, worst, fits, oom=_agree(float(oom), dist.ReduceOp.MAX) > 0)


def auto_micro_batch(run: ResolvedRun, parts: Components, budget: int) -> AutoChoice:
    """Resolve ``accum.micro_batch=auto`` for ``run`` (resolved with its provisional split) on the current
    process group (collective): the :func:`search` over trial windows within ``budget`` bytes per rank.
    Rank 0 prints the choice. Raises :class:`ConfigError` when one sample per micro-batch does not fit
    (naming what it needs)."""
    world = dist.get_world_size()
    measure = TrialMeasure(run, parts, budget)
    best, probes = search(micro_batch_sizes(measure.global_batch, world), measure, measure.budget)
    if best is None:
        raise budget_too_small(None if probes[0].oom else probes[0].peak_bytes, measure.budget, run.device)
    chosen = next(p for p in probes if p.micro_batch == best)
    choice = AutoChoice(
        best,
        measure.global_batch // world // best,
        chosen.peak_bytes,
        measure.budget,
        memory_kind(run.device),
        probes,
    )
    if dist.get_rank() == 0:
        print(f"distaccum: {choice.describe()}", flush=True)
    return choice
