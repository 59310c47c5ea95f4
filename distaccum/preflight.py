"""Everything that can be checked before a worker starts, so bad input is one paragraph (exit 2 in the CLI).

Config values are validated when the RunConfig is built; here come the checks that need the user's
components or the machine. :func:`instantiate_components` turns the ``_target_`` nodes into objects
(Hydra's ``instantiate`` in its conventional role, with errors that name the component, its
``_target_`` and the fix; the one library module that imports Hydra). :func:`preflight` then resolves
the run (:mod:`distaccum.resolve`: the split, the engine/precision combination), builds and checks the
model as the workers will (activation checkpointing, the normalization probe, a dataset's own
``check_model``, the data order, the held-out split), ``init_from``, a resumable checkpoint, the memory
budget of ``micro_batch=auto`` and a writable ``run_dir``. The CLI and the Python ``verify`` API call it.

The current directory is importable (as it is for the workers, which run ``python -m``), so
``mytask.py`` next to the command works without installing it. The model node's keys are its
factory's keyword arguments, except the ones distaccum reserves (:data:`MODEL_RESERVED`).
"""

from __future__ import annotations

import inspect
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from distaccum.activation_checkpointing import parse_checkpointing
from distaccum.components import Components
from distaccum.config import ConfigError, Node, RunConfig
from distaccum.resolve import ResolvedRun, prepare, resolve
from distaccum.rundir.resume import check_resumable
from distaccum.runtime.procgroup import planned_device

REQUIRED = ("model", "dataset", "loss")
MODEL_RESERVED = ("activation_checkpointing",)
"""Keys of the model node that configure distaccum, not the model factory."""


def _importable_cwd() -> None:
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _locate(what: str, node: Node) -> Any:
    from hydra.utils import get_object

    target = node["_target_"]
    try:
        return get_object(target)
    except Exception as err:  # ImportError, AttributeError, ValueError from hydra's locator
        cause = err.__cause__ or err
        raise ConfigError(
            f"{what}: cannot import _target_ {target!r}: {type(cause).__name__}: {cause}. "
            "Check the spelling and that its module is importable (on PYTHONPATH, installed, "
            "or in the current directory)"
        ) from err


def _instantiate(what: str, node: Node, *, partial: bool) -> Any:
    from hydra.utils import instantiate

    obj = _locate(what, node)
    kwargs = {k: v for k, v in node.items() if not k.startswith("_")}
    if not callable(obj):
        raise ConfigError(f"{what}: _target_ {node['_target_']!r} is a {type(obj).__name__}, not callable")
    try:
        return instantiate({**node, "_partial_": partial}, _convert_="all")
    except Exception as err:
        cause = err.__cause__ or err
        raise ConfigError(
            f"{what}: building {node['_target_']}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) "
            f"failed: {type(cause).__name__}: {cause}"
        ) from err


def _callable_node(what: str, node: Node) -> Callable[..., Any]:
    """A loss or collate: a function (``_partial_`` implied) or an object built by a class target."""
    target = _locate(what, node)
    wants_partial = node.get("_partial_", inspect.isfunction(target) or inspect.isbuiltin(target))
    value = _instantiate(what, node, partial=bool(wants_partial))
    if not callable(value):
        raise ConfigError(
            f"{what}: _target_ {node['_target_']!r} gave a {type(value).__name__}, which is not callable"
        )
    return value


def instantiate_components(cfg: RunConfig) -> Components:
    """The model factory (called later, per rank, after seeding), dataset, collate, loss and eval dataset."""
    _importable_cwd()
    missing = [
        name
        for name, node in (("model", cfg.model), ("dataset", cfg.data.dataset), ("loss", cfg.loss))
        if node is None
    ]
    if missing:
        raise ConfigError(
            f"no {', '.join(missing)} configured: select a config group (model=..., data=..., "
            "loss=...) or give a _target_ node"
        )
    assert cfg.model is not None and cfg.data.dataset is not None and cfg.loss is not None
    model_node = {k: v for k, v in cfg.model.items() if k not in MODEL_RESERVED}
    try:
        checkpointing = parse_checkpointing(cfg.model.get("activation_checkpointing"))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    _locate("model", model_node)
    model = _instantiate("model", model_node, partial=True)  # built per rank, after seeding
    dataset = _instantiate("data.dataset", cfg.data.dataset, partial=False)
    collate = _callable_node("data.collate", cfg.data.collate) if cfg.data.collate else None
    loss = _callable_node("loss", cfg.loss)
    eval_dataset = _instantiate("eval.dataset", cfg.eval.dataset, partial=False) if cfg.eval.dataset else None
    names = {"model": cfg.describe("model"), "dataset": cfg.describe("dataset"), "loss": cfg.describe("loss")}
    if collate is not None:
        names["collate"] = cfg.describe("collate")
    return Components(
        model=model,
        dataset=dataset,
        loss=loss,
        collate=collate,
        names=names,
        activation_checkpointing=checkpointing,
        eval_dataset=eval_dataset,
    )


def check_elastic(cfg: RunConfig, device: torch.device) -> None:
    """An elastic launch may continue on MIN..MAX-1 nodes too: the run must resolve on each of those worlds
    (the global batch's split is checked when the config is built; here the engine's layout, e.g. HSDP replicas)."""
    low, high = cfg.trainer.node_range()
    for nodes in range(low, high):
        world = cfg.trainer.nproc * nodes
        try:
            resolve(cfg, world, device, nodes=nodes)
        except ValueError as err:
            raise ConfigError(
                f"trainer.nnodes={cfg.trainer.nnodes}: the run may continue on {nodes} node(s), a world of "
                f"{world}, where it cannot run: {err}"
            ) from err


@dataclass
class Checked:
    """What pre-flight built: the components (for verify's reference), the resolved run and a checked
    model (with micro_batch=auto and a memory budget on CPU, also stepped once to measure one sample)."""

    components: Components
    run: ResolvedRun
    """Resolved on the launch's world; with micro_batch=auto a provisional split (micro-batch 1) of the same
    global batch: the workers measure and pick the real one."""
    model: nn.Module


def check_run_dir(run_dir: str) -> None:
    """Create ``run_dir`` and write a file into it: a clear error instead of a traceback from Hydra or the
    workers (an unwritable or impossible path, a file in the way, a full disk)."""
    path = Path(run_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as err:
        raise ConfigError(
            f"run_dir={run_dir!r} cannot be created and written: {err.strerror or err} "
            f"({os.path.abspath(run_dir)}); choose another run_dir"
        ) from err


def preflight(
    cfg: RunConfig, world_size: int | None = None, *, write: bool = True, nodes: int | None = None
) -> Checked:
    """Run every check; raise ConfigError (exit 2) naming the value and the fix. ``world_size`` and
    ``nodes`` default to the local launch's (``trainer.nproc`` x ``trainer.nnodes``; an elastic launch,
    ``trainer.nnodes=MIN:MAX``: MAX nodes, and the run must resolve on every world it may continue on)."""
    world = world_size or cfg.world_size()
    device = planned_device(cfg.trainer.device)
    try:
        run = resolve(cfg, world, device, nodes=nodes or cfg.trainer.node_range()[1])
    except ValueError as err:
        raise ConfigError(str(err)) from err
    if world_size is None:
        check_elastic(cfg, device)
    if write:
        check_run_dir(cfg.run_dir)
    parts = instantiate_components(cfg)
    names = parts.describe()
    try:
        model = run.model.build(parts)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    except Exception as err:
        raise ConfigError(f"model: calling {names['model']} failed: {type(err).__name__}: {err}") from err
    try:
        prepared = prepare(cfg, run, parts, model=model)
        parts.eval_dataset = prepared.eval_set
        if cfg.trainer.resume:  # an incompatible or corrupt checkpoint: exit 2 now, not in every worker
            check_resumable(Path(cfg.run_dir), prepared.identity, cfg.trainer.schedule_on_resume)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    # accum.memory_budget is checked by the workers, where the memory is spent (exit 2 there, one message): a peak
    # measured in this process (its own libraries, Hydra, torch elastic) is not a worker's.
    return Checked(parts, run, model)
