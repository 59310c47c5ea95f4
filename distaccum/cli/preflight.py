"""Everything that can be checked before a worker starts, so bad input exits 2 in one paragraph.

Config values are validated when the RunConfig is built; here come the checks that need the
user's components or the machine: the engine/precision combination, importing and building every
``_target_``, the normalization probe (and a dataset's own ``check_model``: vocabulary, positions),
the data plan, the held-out split, ``init_from`` and a writable ``run_dir``.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import default_collate

from distaccum.cli.instantiate import instantiate_components
from distaccum.components import Components, build_model
from distaccum.config import ConfigError, RunConfig, Split
from distaccum.engines import check_engine
from distaccum.engines.base import EngineSpec, Precision
from distaccum.evaluate import eval_dataset
from distaccum.plan import GlobalBatchPlan
from distaccum.probe import probe
from distaccum.stream import is_stream


@dataclass
class Checked:
    """What pre-flight built: the components (for verify's reference) and a probed model."""

    components: Components
    model: nn.Module
    split: Split


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
    try:
        split = cfg.split(world_size)
        check_engine(engine_spec(cfg, split))
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
        probe(model, parts.dataset, parts.collate or default_collate, parts.loss, names=names)
        if not is_stream(parts.dataset):
            GlobalBatchPlan(len(parts.dataset), split.global_batch, seed=cfg.trainer.seed,  # type: ignore[arg-type]
                            shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
        parts.eval_dataset = eval_dataset(cfg.eval, parts.dataset, parts.eval_dataset)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return Checked(parts, model, split)
