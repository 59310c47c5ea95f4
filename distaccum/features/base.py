"""The one protocol every feature's set-up implements, and the run it assembles.

The Trainer resolves the run, builds what every run has (the engine, the scheduler, the data source, the state, the
checkpointer) and hands each registered feature (:data:`distaccum.features.FEATURES`) the :class:`Assembly` at four
points (and once more for the run summary): before the engine exists (the process-group layout: outer sync narrows
every per-step collective to an island), once the engine is built (an engine that drives it instead: exact
accumulation's), once the engine has wrapped the model (parts built on it, checkpointed with the state), and once the
state has resumed (step monitors). A feature writes what it contributes into the assembly's typed fields; the Trainer
reads the fields and never the feature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

import torch

from distaccum.components import Components
from distaccum.config import RunConfig
from distaccum.engines.base import Engine, EngineSpec
from distaccum.guards.fingerprint import Fingerprint
from distaccum.loop import OuterStep, StepMonitor, TrainState
from distaccum.optim import describe_lr
from distaccum.resolve import Prepared, ResolvedRun
from distaccum.runtime.procgroup import gather_placement
from distaccum.runtime.topology import describe_placement, split_replicas

__all__ = ["Assembly", "Engine", "FeatureSetup", "Placement", "Seam", "SetupBase", "TrainState"]
"""With the assembly, the engine and the state a hook is handed (a feature's set-up imports them from here)."""

T = TypeVar("T")


class Seam(Protocol):
    """The Trainer's testing seam (:func:`distaccum.testing.intercept`): a point's name and the real object in, the
    object (or a fault's wrapper of it) out."""

    def __call__(self, point: str, obj: T) -> T: ...


@dataclass(frozen=True)
class Placement:
    """Groups of ranks that reduce apart (HSDP's replicas, outer sync's islands) and how the run names them."""

    groups: list[list[int]]
    what: str
    """The header line's description of the groups."""
    noun: str
    """What one group is called (``replica``, ``island``)."""
    key: str
    """The config key (``engine.replicas``, ``outer.islands``) that should be a multiple of the node count."""


@dataclass
class Assembly:
    """One run being put together: what the Trainer resolved and built, and what each feature contributes."""

    cfg: RunConfig
    resolved: ResolvedRun
    prepared: Prepared
    components: Components
    seam: Seam
    spec: EngineSpec
    """The engine's spec (a feature may replace it before the engine is built: outer sync adds the islands)."""
    world: int
    """Ranks in every per-step collective's group (an island's ranks when outer-synced)."""
    group_rank: int
    """This rank in that group."""
    group: Any = None
    """Every per-step collective's process group (None: the world)."""
    host_group: Callable[[], Any] = lambda: None
    """The group the step timer's host tensors gather over (called once, when the timer is built)."""
    placement: Placement | None = None
    """Groups that reduce apart, when a feature lays them out (else the engine's own: HSDP)."""
    outer: OuterStep | None = None
    """The outer step after every optimizer step (checkpointed with the state)."""
    batches: list[list[int]] | None = None
    """(first step, global batch) phases when the global batch changes during the run (the lr scheduler follows)."""
    describe_steps: Callable[[float], str | None] | None = None
    """What rank 0 prints about the steps' batches and learning rate, from the base learning rate (None: the default,
    :meth:`steps_line`)."""
    fingerprint: Fingerprint | None = None
    """The per-step reduction fingerprint (judged a step late, from the next window's collective)."""
    noise_scale: Any = None
    """The gradient noise scale's monitor (``log.gns``; what an adaptive batch decides on), as the seam returned it."""
    monitors: list[StepMonitor] = field(default_factory=list)
    """Step monitors, in the order they run."""
    retry: Any = None
    """Runs each step until it counts (a :class:`~distaccum.loop.StepRetry`: fault-tolerant replica groups)."""
    across: Any = None
    """The sum across fault-tolerant replica groups (``ft.groups``), set before the engine exists, for an engine that
    sums its own gradients to join (exact accumulation's int64 sum: an :class:`~distaccum.exact.engine.AcrossGroups`)."""
    timer: Any = None
    """The run's :class:`~distaccum.telemetry.timing.StepTimer` (set by the Trainer before the monitors attach; typed
    loosely so that telemetry's set-ups import this module and this module nothing of telemetry)."""

    @classmethod
    def of(
        cls, cfg: RunConfig, resolved: ResolvedRun, prepared: Prepared, components: Components, seam: Seam
    ) -> Assembly:
        """A run before any feature attached: the resolved engine spec, every per-step collective over the world."""
        return cls(
            cfg, resolved, prepared, components, seam, resolved.engine, resolved.world_size, resolved.rank
        )

    @property
    def rank(self) -> int:
        return self.resolved.rank

    @property
    def device(self) -> torch.device:
        return self.resolved.device

    def steps_line(self, base_lr: float) -> str | None:
        """What rank 0 prints about the steps: a feature's own description, else the scaled learning rate's."""
        if self.describe_steps is not None:
            return self.describe_steps(base_lr)
        optim = self.cfg.optim
        scaled = optim.lr_scaling != "none"
        return f"distaccum: {describe_lr(optim, self.resolved.global_batch, base_lr)}" if scaled else None

    def place(self, engine: Engine, node: int) -> dict[str, Any] | None:
        """Groups that reduce apart (a feature's :attr:`placement`, else the engine's HSDP replicas): every rank's node
        beside the groups (collective), shown once by rank 0; None when the run has no such groups."""
        laid_out = self.placement
        hsdp = engine.layout() if laid_out is None else None
        if hsdp is not None:
            what = f"HSDP, {len(hsdp)} replicas x {len(hsdp[0])} shards (each replica's shard group)"
            laid_out = Placement(hsdp, what, "replica", "engine.replicas")
        if laid_out is None:
            return None
        groups = laid_out.groups
        placement = gather_placement(groups, node)
        self.announce(
            f"distaccum: {laid_out.what}:\n" + describe_placement(groups, placement["nodes"], laid_out.noun)
        )
        for i in split_replicas(groups, placement["nodes"]):
            self.announce(
                f"distaccum: warning: {laid_out.noun} {i}'s group spans nodes: its reductions (every optimizer step, "
                "every micro-batch with accum.sync=replica_boundary) cross the slow link; make "
                f"{laid_out.key} a multiple of the node count"
            )
        return placement

    def announce(self, line: str | None) -> None:
        """Print ``line`` once, on rank 0."""
        if line is not None and self.rank == 0:
            print(line, flush=True)


class FeatureSetup(Protocol):
    """A feature's set-up: whether it is on for a run, and what it attaches at each point of the assembly."""

    name: ClassVar[str]

    def enabled(self, run: Assembly) -> bool:
        """Whether the feature is on for ``run`` (decided from the resolved run and its config)."""
        ...

    def before_engine(self, run: Assembly) -> None:
        """Before the engine exists: the process-group layout and the engine's spec (may be collective)."""
        ...

    def around_engine(self, run: Assembly, engine: Engine) -> Engine:
        """The engine is built, not yet wrapped around the model: the engine the run uses (``engine``, or one that
        drives it: exact accumulation's)."""
        ...

    def with_engine(self, run: Assembly, engine: Engine) -> None:
        """The engine has wrapped the model: parts built on it that the state checkpoints."""
        ...

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        """The state has resumed ``done`` optimizer steps: step monitors."""
        ...

    def summarize(self, run: Assembly, state: TrainState, summary: dict[str, Any]) -> None:
        """Add the feature's fields to the run summary (``summary.json``) at the end of the run."""
        ...


class SetupBase:
    """Defaults for :class:`FeatureSetup`: on never, and nothing attached at any point."""

    name: ClassVar[str] = "?"

    def enabled(self, run: Assembly) -> bool:
        raise NotImplementedError

    def before_engine(self, run: Assembly) -> None:
        return None

    def around_engine(self, run: Assembly, engine: Engine) -> Engine:
        return engine

    def with_engine(self, run: Assembly, engine: Engine) -> None:
        return None

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        return None

    def summarize(self, run: Assembly, state: TrainState, summary: dict[str, Any]) -> None:
        return None
