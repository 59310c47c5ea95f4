"""Instantiate the ``_target_`` nodes of a RunConfig into the objects the library trains.

Hydra's ``instantiate`` in its conventional role, with errors that name the component, its
``_target_`` and the fix. The current directory is importable (as it is for the workers, which
run ``python -m``), so ``mytask.py`` next to the command works without installing it.

The model node's keys are its factory's keyword arguments, except the ones distaccum reserves
(:data:`MODEL_RESERVED`): they are removed before the factory is called and passed to the library
as typed values.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from distaccum.activation_checkpointing import parse_checkpointing
from distaccum.components import Components
from distaccum.config import ConfigError, Node, RunConfig

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
        raise ConfigError(f"{what}: cannot import _target_ {target!r}: {type(cause).__name__}: {cause}. "
                          "Check the spelling and that its module is importable (on PYTHONPATH, installed, "
                          "or in the current directory)") from err


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
        raise ConfigError(f"{what}: building {node['_target_']}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) "
                          f"failed: {type(cause).__name__}: {cause}") from err


def _callable_node(what: str, node: Node) -> Callable[..., Any]:
    """A loss or collate: a function (``_partial_`` implied) or an object built by a class target."""
    target = _locate(what, node)
    wants_partial = node.get("_partial_", inspect.isfunction(target) or inspect.isbuiltin(target))
    value = _instantiate(what, node, partial=bool(wants_partial))
    if not callable(value):
        raise ConfigError(f"{what}: _target_ {node['_target_']!r} gave a {type(value).__name__}, which is not "
                          "callable")
    return value


def instantiate_components(cfg: RunConfig) -> Components:
    """The model factory (called later, per rank, after seeding), dataset, collate, loss and eval dataset."""
    _importable_cwd()
    missing = [name for name, node in (("model", cfg.model), ("dataset", cfg.data.dataset), ("loss", cfg.loss))
               if node is None]
    if missing:
        raise ConfigError(f"no {', '.join(missing)} configured: select a config group (model=..., data=..., "
                          "loss=...) or give a _target_ node")
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
    return Components(model=model, dataset=dataset, loss=loss, collate=collate, names=names,
                      activation_checkpointing=checkpointing, eval_dataset=eval_dataset)
