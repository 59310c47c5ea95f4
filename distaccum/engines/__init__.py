"""Engine registry: one class per distributed engine, all behind :class:`~distaccum.engines.base.Engine`.

Engine modules are imported on first use (``importlib``): DeepSpeed and Accelerate are optional,
and importing one engine never imports another. Add an engine by adding a line to :data:`ENGINES`.
"""

from __future__ import annotations

from distaccum import load_entry
from distaccum.config import ENGINES as ENGINE_NAMES
from distaccum.engines.base import Engine, EngineBase, EngineSpec
from distaccum.telemetry.ledger import CommLedger

ENGINES: dict[str, str] = {
    "ddp": "distaccum.engines.ddp:DDPEngine",
    "fsdp": "distaccum.engines.fsdp:FSDPEngine",
    "deepspeed": "distaccum.engines.deepspeed:DeepSpeedEngine",
    "accelerate": "distaccum.engines.accelerate:AccelerateEngine",
}
"""Engine name -> ``module:Class``."""

assert set(ENGINES) == set(ENGINE_NAMES), "config.ENGINES and the registry must list the same engines"


def engine_class(name: str) -> type[EngineBase]:
    """The class registered under ``name`` (imports its module)."""
    if name not in ENGINES:
        raise ValueError(f"engine.name={name!r} is not one of {', '.join(ENGINES)}")
    return load_entry(ENGINES[name])


def worker_imports(name: str) -> tuple[str, ...]:
    """What the workers of engine ``name`` import beyond the Trainer (:attr:`EngineBase.worker_imports`)."""
    return engine_class(name).worker_imports


def check_engine(spec: EngineSpec) -> None:
    """Raise ValueError for combinations the engine cannot run (called before workers start)."""
    engine_class(spec.engine.name).check(spec)


def make_engine(spec: EngineSpec, ledger: CommLedger) -> Engine:
    """A new engine for ``spec`` (call after the process group exists)."""
    return engine_class(spec.engine.name)(spec, ledger)  # type: ignore[return-value]  # each class is an Engine
