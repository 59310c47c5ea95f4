"""The testing seam: faults come from outside, by wrapping the real objects a run is built from.

The product has no switches that exist only for tests. Instead the :class:`~distaccum.trainer.Trainer`
passes each object it builds through :func:`intercept` at one place (``Trainer.setup``), under the name
of its :data:`POINTS` entry; with nothing installed that returns the object itself. A :class:`Fault`
installed in the process (:func:`injected` for a block, or :class:`Inject` as a component in a config,
which reaches the workers a launcher starts) may return a wrapper instead, and a test asserts what the
product does about it: the tripwire, the fingerprint, verify, the non-finite policy, a checkpoint that
survives a failed write. ``distaccum bugzoo`` injects its bugs the same way
(:mod:`distaccum.testing.faults` holds them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, TypeVar

T = TypeVar("T")

POINTS = {
    "loss": "the loss function (model, batch) -> (loss_sum, n_items)",
    "engine": "the engine, before it wraps the model (its comm_hook, sync, backward and step)",
    "source": "this rank's window source (its micro-batches)",
    "scheduler": "the learning-rate scheduler",
    "checkpoint_writer": "the writer of distaccum's own checkpoint files",
    "outer": "an outer-synced run's outer step (its reduce across the islands)",
    "ft": "a fault-tolerant run's torchft session (its quorum, its reduction across replica groups, its commit)",
    "gns": "the noise-scale monitor (log.gns: each step's estimate, which the adaptive batch decides on)",
}
"""The objects a run passes through the seam, and what each is."""


class Fault(Protocol):
    """Something wrong, on purpose: returns a wrapper for the objects it targets, the object otherwise."""

    def wrap(self, point: str, obj: Any) -> Any: ...


_installed: list[Fault] = []


def intercept(point: str, obj: T) -> T:
    """``obj`` after every installed fault had the chance to wrap it (``obj`` itself when none is installed)."""
    if point not in POINTS:
        raise ValueError(f"unknown interception point {point!r}; one of {', '.join(POINTS)}")
    for fault in _installed:
        obj = fault.wrap(point, obj)
    return obj


def install(*faults: Fault) -> None:
    """Install ``faults`` in this process, for every run built after this call."""
    _installed.extend(faults)


def uninstall(*faults: Fault) -> None:
    """Remove ``faults`` (all when none is named)."""
    if not faults:
        _installed.clear()
    for fault in faults:
        _installed.remove(fault)


def installed() -> list[Fault]:
    """The faults installed in this process."""
    return list(_installed)


@contextmanager
def injected(*faults: Fault) -> Iterator[None]:
    """Install ``faults`` for the block (runs built inside it get them)."""
    install(*faults)
    try:
        yield
    finally:
        uninstall(*faults)


class Inject:
    """A config component that installs faults in the process that builds it, then stands for ``component``.

    Wrap the run's loss with it so that every worker a launcher starts installs the faults when it builds
    its components (the verify reference, which never builds an engine, is not affected by faults at the
    other points)::

        loss:
          _target_: distaccum.testing.Inject
          component: {_target_: distaccum.losses.mse, _partial_: true}
          faults: [{_target_: distaccum.testing.faults.SkipReduction, rank: 1}]
    """

    def __init__(self, component: Callable[..., Any], faults: Sequence[Fault] = ()) -> None:
        self.component = component
        self.faults = list(faults)
        install(*self.faults)
        # The loss's own name in messages and records, not this wrapper's.
        inner = getattr(component, "func", component)
        self.__module__ = getattr(inner, "__module__", type(self).__module__)
        self.__qualname__ = getattr(inner, "__qualname__", type(inner).__qualname__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.component(*args, **kwargs)
