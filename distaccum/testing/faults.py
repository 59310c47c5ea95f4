"""Faults for tests and the bug zoo: each wraps a real object at a :data:`~distaccum.testing.POINTS` entry.

Every fault is an ordinary object (``_target_``-constructible, so :class:`~distaccum.testing.Inject` can
install it in launched workers) whose ``wrap(point, obj)`` returns a wrapper at the points it targets.
"""

# No ``from __future__ import annotations``: DDP inspects a comm hook's real annotations.

import errno
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from distaccum.data.pipeline import WindowBatches


class Proxy:
    """Forwards every attribute (read and write) to the wrapped object; subclasses override methods."""

    def __init__(self, inner: Any) -> None:
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.inner, name, value)


class WatchedSource(Proxy):
    """A window source that remembers the window it served last (``current``)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        object.__setattr__(self, "current", None)

    def window(self) -> "WindowBatches":
        window = self.inner.window()
        object.__setattr__(self, "current", window)
        return window


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


class LossAtSteps:
    """A fault on the loss of chosen 1-based optimizer steps: watches the window source to know the step, and wraps
    the loss so that :meth:`change` rewrites the summed loss where :meth:`hits` the step (subclasses say both)."""

    def __init__(self) -> None:
        self.source: WatchedSource | None = None

    def hits(self, step: int) -> bool:
        raise NotImplementedError

    def change(self, summed: Any) -> Any:
        raise NotImplementedError

    def wrap(self, point: str, obj: Any) -> Any:
        if point == "source":
            self.source = WatchedSource(obj)
            return self.source
        if point == "loss":

            def loss(model: Any, batch: Any) -> Any:
                summed, n_items = obj(model, batch)
                window = self.source.current if self.source is not None else None
                if window is not None and self.hits(window.step + 1):
                    summed = self.change(summed)
                return summed, n_items

            return loss
        return obj


class NanLoss(LossAtSteps):
    """Rank ``rank``'s loss is NaN at 1-based optimizer steps ``step`` .. ``step + steps - 1``."""

    def __init__(self, step: int, steps: int = 1, rank: int = 0) -> None:
        super().__init__()
        self.steps = range(step, step + steps)
        self.rank = rank

    def hits(self, step: int) -> bool:
        return step in self.steps and rank() == self.rank

    def change(self, summed: Any) -> Any:
        return summed * float("nan")


class LossSurge(LossAtSteps):
    """Every rank's loss is multiplied by ``factor`` (a power of two: exact in floating point) at 1-based optimizer step
    ``step``: a gradient that outgrows ``accum.exact``'s fixed-point headroom (a redo), the same for every split."""

    def __init__(self, step: int, factor: float = 4096.0) -> None:
        super().__init__()
        self.step, self.factor = step, factor

    def hits(self, step: int) -> bool:
        return step == self.step

    def change(self, summed: Any) -> Any:
        return summed * self.factor


class SkipReduction:
    """Rank ``rank`` takes part in every gradient all-reduce but keeps its own local gradient (the ranks
    desynchronize). Wraps the engine's comm hook, so it needs an engine that has one (DDP, Accelerate)."""

    def __init__(self, rank: int = 1) -> None:
        self.rank = rank

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "engine" or rank() != self.rank:
            return obj
        if not hasattr(obj, "comm_hook"):
            raise ValueError(f"SkipReduction wraps a gradient comm hook; engine {obj.name!r} has none")
        original = obj.comm_hook

        def keep_local(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            local = bucket.buffer().clone()
            return original(state, bucket).then(lambda _: local)

        obj.comm_hook = keep_local
        return obj


class ScaledStep(Proxy):
    """An engine whose normalization (the ``grad_scale`` its step applies) is multiplied by ``factor()``."""

    def __init__(self, inner: Any, factor: Any) -> None:
        super().__init__(inner)
        object.__setattr__(self, "factor", factor)

    def step(self, max_norm: float | None, grad_scale: float) -> Any:
        return self.inner.step(max_norm, grad_scale * self.factor())


class GradScale:
    """Every normalized gradient is multiplied by the constant ``factor``: a split-independent bug (a loss
    divided twice, a world size applied twice) that only a reference independent of the loop can see."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def wrap(self, point: str, obj: Any) -> Any:
        return ScaledStep(obj, lambda: self.factor) if point == "engine" else obj


class NominalPartialCount:
    """A partial window is normalized by the item count a full one would hold (N x global_batch / samples)
    instead of what it holds: the remainder-window bug, the same on every split."""

    def __init__(self) -> None:
        self.source: WatchedSource | None = None

    def _factor(self) -> float:
        window = self.source.current if self.source is not None else None
        if window is None or not window.partial:
            return 1.0
        return window.samples / self.source.split.global_batch  # type: ignore[union-attr]

    def wrap(self, point: str, obj: Any) -> Any:
        if point == "source":
            self.source = WatchedSource(obj)
            return self.source
        return ScaledStep(obj, self._factor) if point == "engine" else obj


class FailingWriter(Proxy):
    """A checkpoint writer whose write of the trainer state after step ``step`` fails on a full disk."""

    def __init__(self, inner: Any, step: int) -> None:
        super().__init__(inner)
        object.__setattr__(self, "step", step)

    def write_text(self, path: Path, text: str) -> None:
        found = re.match(r"step-(\d+)", path.parent.name)
        if found and int(found.group(1)) == self.step:
            raise OSError(errno.ENOSPC, f"No space left on device (a test's fault, writing {path.name})")
        self.inner.write_text(path, text)


class FullDisk:
    """The checkpoint written after optimizer step ``step`` fails midway, as a full disk would (ENOSPC):
    the engine state is written, the trainer state is not."""

    def __init__(self, step: int) -> None:
        self.step = step

    def wrap(self, point: str, obj: Any) -> Any:
        return FailingWriter(obj, self.step) if point == "checkpoint_writer" else obj


class SkewedGns(Proxy):
    """A noise-scale monitor whose smoothed estimate reads one unit in the last place high."""

    def latest(self, step: int) -> dict:
        fields = dict(self.inner.latest(step))
        fields["gns_smoothed"] = float(
            torch.nextafter(
                torch.tensor(fields["gns_smoothed"], dtype=torch.float64),
                torch.tensor(float("inf"), dtype=torch.float64),
            )
        )
        return fields


class SkewedNoiseScale:
    """Rank ``rank`` sees the smoothed noise scale 1 ulp off: the adaptive batch's ranks must notice they disagree."""

    def __init__(self, rank: int = 1) -> None:
        self.rank = rank

    def wrap(self, point: str, obj: Any) -> Any:
        return SkewedGns(obj) if point == "gns" and rank() == self.rank else obj


class KillGroup:
    """Signals its own process (SIGKILL by default; SIGSTOP hangs it) in replica group ``group`` of a fault-tolerant
    run (``ft.groups``), on that group's first launch only (``DISTACCUM_FT_RESTART`` 0: a restarted group runs clean):
    at the loss's ``call``-th call (1-based: in the middle of a step's micro-batches), or as the group enters the
    reduction across groups of 1-based step ``step`` (the other groups are then in it, waiting). ``rejoin_s``: the
    restarted group waits that long before its first quorum (a slow restart: the others go on without it)."""

    def __init__(
        self,
        group: int,
        call: int | None = None,
        step: int | None = None,
        signal: str = "SIGKILL",
        rejoin_s: float = 0.0,
    ) -> None:
        self.group, self.call, self.step, self.signal, self.rejoin_s = group, call, step, signal, rejoin_s
        self.calls = 0

    def _mine(self) -> bool:
        import os

        return os.environ.get("REPLICA_GROUP_ID") == str(self.group)

    def _first(self) -> bool:
        import os

        return os.environ.get("DISTACCUM_FT_RESTART", "0") == "0"

    def _fire(self) -> None:
        import os
        import signal

        os.kill(os.getpid(), getattr(signal, self.signal))

    def wrap(self, point: str, obj: Any) -> Any:
        if not self._mine():
            return obj
        if not self._first():
            if (
                point == "ft" and self.rejoin_s
            ):  # before its Manager exists: the Lighthouse does not wait for it
                import time

                time.sleep(self.rejoin_s)
            return obj
        if point == "loss" and self.call is not None:

            def loss(model: Any, batch: Any) -> Any:
                self.calls += 1
                if self.calls == self.call:
                    self._fire()
                return obj(model, batch)

            return loss
        if point == "ft" and self.step is not None:
            fault = self

            class Reducing(Proxy):
                def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
                    if self.inner.step + 1 == fault.step:  # its first reduction across groups in that step
                        fault._fire()
                    self.inner.all_reduce(tensor, op)

            return Reducing(obj)
        return obj


class AwaitRejoin:
    """Holds replica group ``waiting`` at its loss's ``call``-th call until group ``restarted``, started again after
    it died (``DISTACCUM_FT_RESTART`` > 0), asks for its first quorum (its Manager then exists: the Lighthouse waits
    for it at the next quorum), which it says by creating the file ``marker``. A restart then heals whatever the
    machine's speed, instead of racing the survivors to the end of the run."""

    def __init__(
        self, waiting: int, restarted: int, call: int, marker: str, timeout_s: float = 120.0
    ) -> None:
        self.waiting, self.restarted, self.call = waiting, restarted, call
        self.marker, self.timeout_s = marker, timeout_s
        self.calls = 0

    def wrap(self, point: str, obj: Any) -> Any:
        import os
        from pathlib import Path

        group = os.environ.get("REPLICA_GROUP_ID")
        marker = Path(self.marker)
        if (
            point == "ft"
            and group == str(self.restarted)
            and os.environ.get("DISTACCUM_FT_RESTART", "0") != "0"
        ):

            class Asking(Proxy):
                def quorum(self, step: int) -> Any:
                    marker.touch()
                    return self.inner.quorum(step)

            return Asking(obj)
        if point == "loss" and group == str(self.waiting):
            fault = self

            def loss(model: Any, batch: Any) -> Any:
                import time

                fault.calls += 1
                if fault.calls == fault.call:
                    deadline = time.monotonic() + fault.timeout_s
                    while not marker.exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
                return obj(model, batch)

            return loss
        return obj


class KillRank:
    """Rank ``rank`` signals its own process (SIGKILL by default) at the loss's ``call``-th call (1-based: count the
    micro-batches, a redone step's included, to land in the middle of a step). In a world without that rank, or in a
    run resumed from the killed one with the same loss config, it does nothing."""

    def __init__(self, rank: int, call: int, signal: str = "SIGKILL") -> None:
        self.rank, self.call, self.signal = rank, call, signal
        self.calls = 0

    def wrap(self, point: str, obj: Any) -> Any:
        import os
        import signal

        if point != "loss" or rank() != self.rank or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
            return obj

        def loss(model: Any, batch: Any) -> Any:
            self.calls += 1
            if self.calls == self.call:
                os.kill(os.getpid(), getattr(signal, self.signal))
            return obj(model, batch)

        return loss


class SlowLoss:
    """Every loss call takes ``seconds`` longer (slow steps, so that a test's events fall between steps on any
    machine)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wrap(self, point: str, obj: Any) -> Any:
        if point != "loss":
            return obj

        def loss(model: Any, batch: Any) -> Any:
            import time

            time.sleep(self.seconds)
            return obj(model, batch)

        return loss
