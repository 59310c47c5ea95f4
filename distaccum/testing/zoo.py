"""The bug zoo's bugs: known gradient-accumulation mistakes, each a fault that wraps a real object.

Each class is an ordinary :class:`~distaccum.testing.Fault` (``wrap(point, obj)``), ``_target_``-constructible
so :class:`~distaccum.testing.Inject` installs it in the workers a launcher starts. Together with the
faults of :mod:`distaccum.testing.faults` (``SkipReduction``, ``NominalPartialCount``) and the misplaced syncs of
:mod:`distaccum.testing.nosync` they are what
``distaccum bugzoo`` (:mod:`distaccum.verify.bugzoo`) injects; each docstring says what a real loop that
has the bug does, and the wrapper does exactly that to the real engine, loss, scheduler or source.
"""

# No ``from __future__ import annotations``: DDP inspects a comm hook's real annotations (faults.py).

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distaccum.data.pipeline import OrderSource, batch_size
from distaccum.engines.comm_tap import tap_gradient_reductions
from distaccum.engines.ddp import DDPEngine
from distaccum.engines.deepspeed import DeepSpeedEngine
from distaccum.testing.faults import Proxy


class MeanPerMicroBatch:
    """loss/K: each micro-batch's loss is its mean over its own loss items and the window averages the K x W
    micro-batch means (the loss reports one item per micro-batch, so the loop's global count is K x W). The
    classic recipe and the 2024 Transformers bug: with variable-length items, items of short micro-batches
    weigh more than those of long ones."""

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "loss":
            return obj

        def mean_loss(model: Any, batch: Any) -> Any:
            summed, n_items = obj(model, batch)
            return summed / torch.as_tensor(n_items, dtype=summed.dtype).clamp(min=1), 1

        return mean_loss


class PerSampleMean:
    """The mean-per-micro-batch normalisation over samples: each micro-batch's summed loss is divided by its
    number of samples (``loss_per_sample.mean()``), then the window by K x W: with sequences of different
    lengths the step is normalised by samples, not by the tokens that carry the loss."""

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "loss":
            return obj

        def per_sample(model: Any, batch: Any) -> Any:
            summed, _ = obj(model, batch)
            return summed, batch_size(batch)

        return per_sample


class MicroCounter(Proxy):
    """An engine that knows which micro-batch of the window (0-based) its ``sync``/``backward`` is at."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        object.__setattr__(self, "calls", 0)

    def micro(self) -> int:
        return self.calls % self.inner.spec.split.accum_steps

    def next_micro(self) -> None:
        object.__setattr__(self, "calls", self.calls + 1)


class EarlySync(MicroCounter):
    def __init__(self, inner: Any, from_step: int) -> None:
        super().__init__(inner)
        object.__setattr__(self, "from_step", from_step)

    @contextlib.contextmanager
    def sync(self, enabled: bool) -> Iterator[None]:
        k, last = self.micro(), self.inner.spec.split.accum_steps - 1
        step = self.calls // self.inner.spec.split.accum_steps + 1
        self.next_micro()
        with self.inner.sync(k == last - 1 if last > 0 and step >= self.from_step else enabled):
            yield


class NoSyncOffByOne:
    """``no_sync`` on the wrong micro-batch: from optimizer step ``from_step`` on, the window's one reduction
    runs with micro-batch K-1 instead of K, so the last micro-batch's gradient stays on its rank (one missing
    reduction). The other variant, one extra reduction, is harmless under DDP's mean-reducing hook
    (averaging values every rank already agrees on changes nothing; it costs one more all-reduce); it
    corrupts only a SUM-reducing hook."""

    def __init__(self, from_step: int = 1) -> None:
        self.from_step = from_step

    def wrap(self, point: str, obj: Any) -> Any:
        return EarlySync(obj, self.from_step) if point == "engine" else obj


class StaticGraphEngine(Proxy):
    def wrap(self, model: Any, make_optimizer: Any) -> Any:
        # What DDPEngine.wrap does, with static_graph=True: a real DDP, the engine's own comm hook.
        engine = self.inner
        engine.raw = model.to(device=engine.device, dtype=engine.precision.param_dtype)
        return engine.adopt(DDP(engine.raw, **engine.ddp_arguments(), static_graph=True), make_optimizer)


class StaticGraph:
    """``DistributedDataParallel(static_graph=True)`` with ``no_sync`` (pytorch/pytorch#187732): a real DDP
    built with the flag, driven by the unchanged loop. Engine ``ddp`` only."""

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "engine":
            return obj
        if not isinstance(obj, DDPEngine):
            raise ValueError(f"StaticGraph builds a DDP module; engine {obj.name!r} is not DDP")
        return StaticGraphEngine(obj)


class DefaultScaledBackward(Proxy):
    def backward(self, loss: torch.Tensor) -> None:
        with tap_gradient_reductions(self.inner.ledger):
            self.inner.engine.backward(loss)  # DeepSpeed's default scale_wrt_gas=True: loss / K again


def on_deepspeed(point: str, obj: Any, wrapper: Callable[[Any], Any], what: str) -> Any:
    """``wrapper(obj)`` for the engine, which must be DeepSpeed (a fault of DeepSpeed's own code paths)."""
    if point != "engine":
        return obj
    if not isinstance(obj, DeepSpeedEngine):
        raise ValueError(f"{what}; engine {obj.name!r} is not DeepSpeed")
    return wrapper(obj)


class DeepSpeedScaleWrtGas:
    """The loss scaled twice on DeepSpeed: ``engine.backward(loss)`` with DeepSpeed's default
    ``scale_wrt_gas=True`` divides by ``gradient_accumulation_steps`` on top of the loop's own normalisation
    (distaccum passes ``scale_wrt_gas=False``). Engine ``deepspeed`` only."""

    def wrap(self, point: str, obj: Any) -> Any:
        return on_deepspeed(
            point, obj, DefaultScaledBackward, "DeepSpeedScaleWrtGas wraps DeepSpeed's backward"
        )


class ClippingDropped(Proxy):
    def wrap(self, model: Any, make_optimizer: Any) -> Any:
        import deepspeed

        real = deepspeed.initialize

        def initialize(*args: Any, config: dict[str, Any], **kwargs: Any) -> Any:
            dropped = {key: value for key, value in config.items() if key != "gradient_clipping"}
            return real(*args, config=dropped, **kwargs)  # DeepSpeed's default applies: 1.0 since #8068

        deepspeed.initialize = initialize
        try:
            return self.inner.wrap(model, make_optimizer)
        finally:
            deepspeed.initialize = real


class DeepSpeedDefaultClipping:
    """The run reaches DeepSpeed without ``gradient_clipping`` (a config writer that omits keys it considers
    default, gpt-neox #1432): the real ``deepspeed.initialize`` gets the generated config less that key, so
    DeepSpeed's default applies, 1.0 since DeepSpeed #8068, and clips a run whose ``optim.clip_norm`` is null.
    Engine ``deepspeed`` only."""

    def wrap(self, point: str, obj: Any) -> Any:
        return on_deepspeed(
            point, obj, ClippingDropped, "DeepSpeedDefaultClipping wraps deepspeed.initialize"
        )


class TransformedPartitions(Proxy):
    def __init__(self, inner: Any, max_norm: float) -> None:
        super().__init__(inner)
        object.__setattr__(self, "max_norm", max_norm)

    def backward(self, loss: torch.Tensor) -> None:
        from deepspeed.utils import safe_get_local_grad, safe_set_local_grad

        self.inner.backward(loss)  # ZeRO-3, every_micro: this micro-batch is reduced into the partitions
        params = [p for p in self.inner.engine.module.parameters() if p.requires_grad]
        local = [safe_get_local_grad(p) for p in params]  # this rank's partition of the accumulation so far
        squares = torch.stack([g.double().square().sum() for g in local]).sum()
        dist.all_reduce(squares)  # the partitions tile the gradient: its squared norm is their sum over ranks
        coef = min(1.0, self.max_norm / (float(squares.sqrt()) + 1e-6))
        for p, g in zip(params, local, strict=True):
            safe_set_local_grad(p, g * coef)


class TransformPerMicroBatch:
    """An optimizer transform in ZeRO-3's per-micro-batch reduce path (DeepSpeed #8443: Muon's Newton-Schulz ran
    where each micro-batch's gradient is reduced into the partitions, so K = 4 transformed partial gradients). The
    transform here is the one every run has, the clip to ``max_norm`` (``optim.clip_norm``): after each micro-batch's
    reduction the accumulated partitions are clipped (DeepSpeed's public ``safe_get_local_grad`` /
    ``safe_set_local_grad``, the global norm from every rank's partition), instead of once at the step. Engine
    ``deepspeed`` with ``zero_stage=3`` and ``accum.sync=every_micro`` (DeepSpeed's own reduction cadence)."""

    def __init__(self, max_norm: float = 1.0) -> None:
        self.max_norm = max_norm

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "engine":
            return obj
        if not isinstance(obj, DeepSpeedEngine) or obj.stage != 3 or obj.spec.sync != "every_micro":
            raise ValueError(
                "TransformPerMicroBatch needs engine=deepspeed engine.zero_stage=3 accum.sync=every_micro"
            )
        return TransformedPartitions(obj, self.max_norm)


class RepeatedStep(Proxy):
    def __init__(self, inner: Any, times: int) -> None:
        super().__init__(inner)
        object.__setattr__(self, "times", times)

    def step(self, *args: Any, **kwargs: Any) -> None:
        for _ in range(self.times):
            self.inner.step(*args, **kwargs)


class SchedulerPerMicroBatch:
    """The learning-rate schedule stepped once per micro-batch (``times`` = K per optimizer step) instead of
    once per optimizer step: warm-up and decay run K times too fast."""

    def __init__(self, times: int) -> None:
        self.times = times

    def wrap(self, point: str, obj: Any) -> Any:
        return RepeatedStep(obj, self.times) if point == "scheduler" else obj


class ClippedBackward(Proxy):
    def __init__(self, inner: Any, max_norm: float) -> None:
        super().__init__(inner)
        object.__setattr__(self, "max_norm", max_norm)

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)
        torch.nn.utils.clip_grad_norm_(self.inner.unwrapped().parameters(), self.max_norm)


class ClipPerMicroBatch:
    """``clip_grad_norm_(params, max_norm)`` after every micro-batch's backward: the partial, unreduced
    accumulation is clipped K times instead of the window's reduced gradient once."""

    def __init__(self, max_norm: float = 1.0) -> None:
        self.max_norm = max_norm

    def wrap(self, point: str, obj: Any) -> Any:
        return ClippedBackward(obj, self.max_norm) if point == "engine" else obj


class ScalerUpdatedBackward(Proxy):
    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)
        self.inner.scaler.update()


class ScalerUpdatePerMicroBatch:
    """``GradScaler.update()`` after every micro-batch's backward instead of once per optimizer step, after
    ``step()``. Needs ``precision=fp16`` (a GradScaler)."""

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "engine":
            return obj
        if getattr(obj, "scaler", None) is None and not obj.precision.loss_scaling:
            raise ValueError("ScalerUpdatePerMicroBatch needs precision=fp16 (a GradScaler)")
        return ScalerUpdatedBackward(obj)


class UnzeroedEngine(Proxy):
    def wrap(self, model: Any, make_optimizer: Any) -> Any:
        wrapped = self.inner.wrap(model, make_optimizer)
        # The real optimizer, its zero_grad made a no-op: what the step leaves in .grad stays there.
        self.inner.optimizer.zero_grad = lambda set_to_none=True: None
        return wrapped


class GradientsNotZeroed:
    """Gradients not zeroed between windows: the optimizer's ``zero_grad`` never runs, so each window's
    gradient starts from what the previous step left behind."""

    def wrap(self, point: str, obj: Any) -> Any:
        return UnzeroedEngine(obj) if point == "engine" else obj


class WipingEngine(MicroCounter):
    def __init__(self, inner: Any, before: int) -> None:
        super().__init__(inner)
        object.__setattr__(self, "before", before)

    def backward(self, loss: torch.Tensor) -> None:
        if self.micro() == self.before - 1:
            self.inner.optimizer.zero_grad(set_to_none=False)  # in place: DDP's buckets stay
        self.next_micro()
        self.inner.backward(loss)


class GradientsWipedMidWindow:
    """The accumulated gradients wiped mid-window (NeMo Automodel #3530: a re-initialisation zeroed them):
    ``zero_grad()`` runs before the backward of micro-batch ``before`` (1-based), so only the micro-batches
    from there on reach the step."""

    def __init__(self, before: int = 3) -> None:
        self.before = before

    def wrap(self, point: str, obj: Any) -> Any:
        return WipingEngine(obj, self.before) if point == "engine" else obj


class SharedDropoutSeed:
    """Dropout RNG shared across ranks: before every micro-batch's forward each rank re-seeds with the same
    seed (``torch.manual_seed(seed + micro-batch count)``, "for reproducibility"), so every rank draws the
    same dropout masks on its different samples."""

    def __init__(self, seed: int = 1234) -> None:
        self.seed = seed
        self.calls = 0

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "loss":
            return obj

        def reseeded(model: Any, batch: Any) -> Any:
            torch.manual_seed(self.seed + self.calls)
            self.calls += 1
            return obj(model, batch)

        return reseeded


class SameSamples:
    """Every rank reads the same samples: each rank's source serves rank 0's micro-batches (a sampler that
    ignores the rank), so the window holds world copies of a 1/world slice of the batch."""

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "source":
            return obj
        if not isinstance(obj, OrderSource):
            raise ValueError(
                "SameSamples rebuilds a map-style dataset's OrderSource; this run reads a stream"
            )
        return OrderSource(
            obj.dataset,
            obj.collate,
            obj.order,
            obj.split,
            0,
            obj.stop,
            **obj.loader_options,
            float_dtype=obj.float_dtype,
        )
