"""Fault-tolerant replica groups' set-up: this group's torchft session before the engine, the window cut per
quorum and the step computed again once the state exists, the record fields of each step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from distaccum.config import RunConfig
from distaccum.data.pipeline import OrderSource
from distaccum.engines import engine_class
from distaccum.features.base import Assembly, Engine, SetupBase, TrainState
from distaccum.ft.parts import FtRecord, FtRetry, FtSource
from distaccum.ft.session import GROUP_ENV, FtSession


def sharded_checksum(cfg: RunConfig) -> str | None:
    """Why a sharded engine's reduction checksum cannot run in replica groups (None: it can, or it is off)."""
    if engine_class(cfg.engine.name).replicated_gradients or not cfg.trainer.fingerprint or cfg.accum.exact:
        return None  # (exact accumulation takes no checksum: its int64 sum has no rounding to bound)
    return (
        f"engine={cfg.engine.name} checks each step's reduction against its own ranks' gradients (trainer.fingerprint), "
        "and the sum across groups adds the other groups' to it: set trainer.fingerprint=false"
    )


def refusal(cfg: RunConfig) -> str | None:
    """Why ``cfg`` cannot form fault-tolerant replica groups (None: it can)."""
    why = engine_class(cfg.engine.name).ft_refusal or sharded_checksum(cfg)
    if why is None and cfg.outer.enabled:
        why = "outer.method already reduces across islands rarely: use one or the other"
    if why is None and (cfg.accum.ramp.enabled or cfg.accum.adaptive.enabled):
        why = "accum.ramp / accum.adaptive change the global batch, which ft keeps fixed across groups"
    return why


class FtSetup(SetupBase):
    """On when ``ft.groups`` > 0."""

    name: ClassVar[str] = "ft"

    def __init__(self) -> None:
        self.session: FtSession | None = None
        self.engine: Engine | None = None

    def enabled(self, run: Assembly) -> bool:
        return run.cfg.ft.enabled

    def before_engine(self, run: Assembly) -> None:
        """Refuse what cannot form replica groups; this group's session (its Manager starts with the state)."""
        cfg, resolved = run.cfg.ft, run.resolved
        why = refusal(run.cfg)
        if why is not None:
            raise ValueError(f"ft.groups={cfg.groups}: {why}")
        cfg.check_split(resolved.split.global_batch, resolved.split.micro_batch, run.world)
        if GROUP_ENV not in os.environ:
            raise ValueError(
                f"ft.groups={cfg.groups}: {GROUP_ENV} is not set: start the groups with `distaccum train` (which "
                f"sets it), or give each group's launch {GROUP_ENV}=0..{cfg.groups - 1} (docs/failures.md)"
            )
        group = int(os.environ[GROUP_ENV])
        if not 0 <= group < cfg.groups:
            raise ValueError(f"{GROUP_ENV}={group} is not one of the groups 0..{cfg.groups - 1} (ft.groups)")
        self.session = run.seam(
            "ft", FtSession(cfg, group, run.group_rank, run.world, Path(resolved.run_dir))
        )
        run.across = self.session  # for an engine that sums its own gradients (exact accumulation's)
        run.announce(
            f"distaccum: replica group {group} of {cfg.groups} ({run.world} rank(s)), at least ft.min_groups="
            f"{cfg.min_groups} per step; each step's window cut for the groups present"
        )

    def with_engine(self, run: Assembly, engine: Engine) -> None:
        self.engine = engine

    def with_state(self, run: Assembly, state: TrainState, done: int) -> None:
        """The window source cut per quorum, the Manager (with the state a healing group loads), the retry."""
        session, engine = self.session, self.engine
        assert session is not None and engine is not None
        timed: Any = state.source
        inner = timed.source
        if not isinstance(inner, OrderSource):
            raise ValueError(
                f"ft.groups={run.cfg.ft.groups} needs a map-style dataset (the global-batch order cuts each step's window for the "
                "groups present); a stream cannot be cut again when a group leaves"
            )
        source = FtSource(inner, session, run.group_rank, run.world)
        timed.source = source

        def state_dict() -> dict[str, Any]:
            return {
                "model": engine.unwrapped().state_dict(),
                "optimizer": engine.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(),
                "source": source.state_dict(),
                # an engine that joined the sum across groups: its own (exact accumulation's scale)
                "carried": [carried() for carried, _ in session.carried],
                "n_prev": state.n_prev,
            }

        def load_state_dict(saved: dict[str, Any]) -> None:
            engine.unwrapped().load_state_dict(saved["model"])
            engine.optimizer.load_state_dict(saved["optimizer"])
            state.scheduler.load_state_dict(saved["scheduler"])
            source.load_state_dict(saved["source"])
            for (_, load), carried in zip(session.carried, saved["carried"], strict=True):
                load(carried)
            state.n_prev = saved["n_prev"]

        session.start(state_dict, load_state_dict)
        if done:
            session.resumed(done)
        run.retry = FtRetry(session, source, engine, state)
        run.monitors.append(FtRecord(session, source))

    def summarize(self, run: Assembly, state: TrainState, summary: dict[str, Any]) -> None:
        assert self.session is not None
        records = state.records
        summary["ft"] = {
            "group": self.session.group,
            "groups": run.cfg.ft.groups,
            "steps_recomputed": sum(int(r.get("ft_attempts", 1)) - 1 for r in records),
            "lost_s": sum(float(r.get("ft_lost_s", 0.0)) for r in records),
            "bytes_across": sum(int(r.get("ft_bytes", 0)) for r in records),
            "healed_at": [int(r["step"]) for r in records if r.get("ft_healed")],
        }
        self.session.shutdown()
