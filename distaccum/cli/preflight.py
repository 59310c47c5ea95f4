"""Everything that can be checked before a worker starts, so bad input exits 2 in one paragraph.

Config values are validated when the RunConfig is built; here come the checks that need the
user's components or the machine: the engine/precision combination, importing and building every
``_target_``, activation checkpointing (its modules exist; no reentrant variant on DDP), the
normalization probe (and a dataset's own ``check_model``: vocabulary, positions), the data plan,
the held-out split, ``init_from`` and a writable ``run_dir``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import default_collate

from distaccum.activation_checkpointing import apply_activation_checkpointing, check_engine_compatible
from distaccum.cli.instantiate import instantiate_components
from distaccum.components import Components, build_model
from distaccum.config import ConfigError, RunConfig, Split, check_split
from distaccum.data.global_batch import GlobalBatchPlan
from distaccum.data.stream import is_stream
from distaccum.engines import check_engine
from distaccum.engines.base import EngineSpec, Precision
from distaccum.evaluate import eval_dataset
from distaccum.probe import probe
from distaccum.rundir.checkpoint import fingerprint
from distaccum.rundir.resume import check_resumable
from distaccum.tuning.autobatch import budget_too_small, one_sample_peak


@dataclass
class Checked:
    """What pre-flight built: the components (for verify's reference) and a probed model (with
    micro_batch=auto and a memory budget on CPU, also stepped once to measure one sample's peak)."""

    components: Components
    model: nn.Module
    split: Split
    """The configured split; with micro_batch=auto a provisional one (micro-batch 1) of the same global
    batch, for the checks: the workers measure and pick the real one."""


def check_run_dir(run_dir: str, *, create: bool = True) -> None:
    """``run_dir`` can be created and written (a clear error instead of a traceback from the workers).

    ``create=False`` only looks: the nearest existing ancestor must be a writable directory.
    """
    path = Path(run_dir)
    if not create:
        existing = path
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            what = "is not a directory" if existing.exists() and not existing.is_dir() else "is not writable"
            raise ConfigError(f"run_dir={run_dir!r} cannot be created: {existing} {what}; choose another run_dir")
        return
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as err:
        raise ConfigError(f"run_dir={run_dir!r} is not writable: {err.strerror or err} "
                          f"({os.path.abspath(run_dir)}); choose another run_dir") from err


def engine_spec(cfg: RunConfig, split: Split) -> EngineSpec:
    """The spec the workers will build (on the device they will pick)."""
    want_cuda = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and torch.cuda.is_available())
    return EngineSpec(engine=cfg.engine, precision=Precision.of(cfg.precision), split=split, sync=cfg.accum.sync,
                      clip_norm=cfg.optim.clip_norm, device=torch.device("cuda" if want_cuda else "cpu"),
                      fault_rank=cfg.debug.skip_reduction_rank)


def preflight(cfg: RunConfig, world_size: int | None = None, *, write: bool = True) -> Checked:
    """Run every check; raise ConfigError (exit 2) naming the value and the fix."""
    world = world_size or cfg.world_size()
    try:
        check_split(cfg.accum, world)
        split = Split(1, cfg.global_batch(world) // world, world) if cfg.accum.auto else cfg.split(world)
        spec = engine_spec(cfg, split)
        check_engine(spec)
        if cfg.log.gns and world < 2:
            raise ValueError("log.gns=true compares each rank's gradient with the reduced one: it needs at least "
                             f"2 ranks, got world_size={world}")
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if write:
        check_run_dir(cfg.run_dir)
    parts = instantiate_components(cfg)
    names = parts.describe()
    try:
        model = build_model(parts.model, cfg.trainer.seed, Precision.of(cfg.precision), cfg.trainer.init_from,
                            names["model"])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    except Exception as err:
        raise ConfigError(f"model: calling {names['model']} failed: {type(err).__name__}: {err}") from err
    try:
        apply_activation_checkpointing(model, parts.activation_checkpointing)
        check_engine_compatible(model, cfg.engine.name)
        probe(model, parts.dataset, parts.collate or default_collate, parts.loss, names=names)
        if not is_stream(parts.dataset):
            GlobalBatchPlan(len(parts.dataset), split.global_batch, seed=cfg.trainer.seed,  # type: ignore[arg-type]
                            shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
        parts.eval_dataset = eval_dataset(cfg.eval, parts.dataset, parts.eval_dataset)
        if cfg.trainer.resume:  # an incompatible or corrupt checkpoint: exit 2 now, not in every worker
            check_resumable(Path(cfg.run_dir), fingerprint(cfg, split.world_size, names, parts.dataset, model))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    budget = cfg.accum.budget_bytes()
    if cfg.accum.auto and budget is not None and spec.device.type == "cpu":
        # One sample's step, measured here; on CUDA the workers measure it (same error, exit 2).
        need = one_sample_peak(model, parts, cfg, spec.device)
        if need is None or need > budget:
            raise budget_too_small(need, budget, spec.device)
    return Checked(parts, model, split)
