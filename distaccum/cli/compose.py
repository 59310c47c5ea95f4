"""Hydra composition: the packaged configs, the user's config directories, overrides -> RunConfig.

The primary config is ``pkg://distaccum.configs`` (it ships inside the package, so an installed
``distaccum`` works from any directory). ``--config-dir DIR`` adds a directory of the user's own
groups (``DIR/model/mytask.yaml``, ``DIR/data/...``, ``DIR/loss/...``) to the search path.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import sys
from pathlib import Path
from typing import Any

from distaccum.config import ConfigError, RunConfig, check_split, from_mapping, to_mapping
from distaccum.outer.config import RENAMED_KEYS, renamed_keys

CONFIG_MODULE = "distaccum.configs"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"
CONFIG_NAME = "config"
COMPONENT_SECTIONS = ("model", "loss")
"""Top-level sections that are component nodes (selected by config groups, default null)."""


def defaults_node() -> dict[str, Any]:
    """Every field's dataclass default, offered to Hydra as the ``distaccum_defaults`` node.

    ``configs/config.yaml`` lists it first, so every field can be overridden from the command line
    (Hydra's struct mode still rejects unknown keys) while the YAML files only select and override. Each old
    key of :data:`~distaccum.outer.config.RENAMED_KEYS` keeps a None slot, so an override or a YAML file may
    still name it (:func:`to_run_config` moves it to its new name and says so).
    """
    node = to_mapping(RunConfig())
    for old in RENAMED_KEYS:
        section, leaf = old.split(".")
        node[section][leaf] = None
    return node


def register_defaults() -> None:
    """Store :func:`defaults_node` in Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="distaccum_defaults", node=defaults_node())


def split_config_dirs(argv: list[str]) -> tuple[list[str], list[Path]]:
    """Take ``--config-dir DIR`` / ``--config-dir=DIR`` / ``-cd DIR`` out of ``argv``."""
    rest: list[str] = []
    dirs: list[Path] = []
    it = iter(argv)
    for arg in it:
        if arg in ("--config-dir", "-cd"):
            value = next(it, None)
            if value is None:
                raise ConfigError(f"{arg} needs a directory")
            dirs.append(Path(value))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
        else:
            rest.append(arg)
    for d in dirs:
        if not d.is_dir():
            raise ConfigError(f"--config-dir {d}: no such directory (from {Path.cwd()})")
    return rest, dirs


def searchpath_override(dirs: list[Path]) -> list[str]:
    """The Hydra override adding user config directories to the search path (before the package's)."""
    if not dirs:
        return []
    return ["hydra.searchpath=[" + ",".join(f"file://{d.resolve()}" for d in dirs) + "]"]


def to_run_config(dcfg: Any, run_dir: str | None = None) -> RunConfig:
    """OmegaConf -> RunConfig at the boundary; raises ConfigError for any invalid value or split."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        values = OmegaConf.to_container(dcfg, resolve=True)
        assert isinstance(values, dict)
        values.pop("hydra", None)
        if run_dir is not None:
            values["run_dir"] = run_dir
        values, notes = renamed_keys({str(k): v for k, v in values.items()})
        for note in notes:
            say_once(f"distaccum: {note}")
        cfg = from_mapping({str(k): v for k, v in values.items()})
        check_split(cfg.accum, cfg.world_size())  # suggests valid splits or global batches
    except (ValueError, OmegaConfBaseException) as err:
        raise ConfigError(str(err)) from err
    return cfg


_SAID: set[str] = set()


def say_once(line: str) -> None:
    """Print ``line`` to stderr once per process (the pre-check and the Hydra app compose the same overrides)."""
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)


def compose_config(argv: list[str]) -> RunConfig:
    """Compose the packaged configs with ``argv`` (overrides and ``--config-dir``) outside a Hydra app
    (workers started by torchrun/srun, ``distaccum submit``)."""
    from hydra import compose, initialize_config_module

    overrides, dirs = split_config_dirs(argv)
    register_defaults()
    with initialize_config_module(version_base="1.3", config_module=CONFIG_MODULE):
        try:
            dcfg = compose(config_name=CONFIG_NAME, overrides=overrides + searchpath_override(dirs))
        except Exception as err:  # hydra's composition errors share no public base class
            raise ConfigError(_suggest_key(str(err), dirs)) from err
    return to_run_config(dcfg)


UNKNOWN_KEY = re.compile(r"Could not override '([^']+)'")


def _suggest_key(message: str, dirs: list[Path]) -> str:
    """Hydra's error for an override of a key the config does not have ("use +key=value", which would add it and
    train without it), with the nearest existing key when one is close: a typo, in all likelihood."""
    match = UNKNOWN_KEY.search(message)
    if not match:
        return message
    from hydra import compose
    from omegaconf import OmegaConf

    known = _leaf_keys(
        OmegaConf.to_container(compose(config_name=CONFIG_NAME, overrides=searchpath_override(dirs)))
    )
    close = difflib.get_close_matches(match.group(1), known, n=1, cutoff=0.8)
    if not close:
        return message
    return (
        f"{match.group(1)} is not a key of the config: did you mean {close[0]}? ("
        f"+{match.group(1)}=... would add it as a new key, which nothing reads unless your own component takes it)"
    )


def _leaf_keys(node: Any, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix]
    keys = [f"{prefix}{k}" for k in node]  # a section itself, too (model, accum.ramp)
    for key, value in node.items():
        if isinstance(value, dict):
            keys += _leaf_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return sorted(set(keys))


def replace_run_dir(cfg: RunConfig, run_dir: str) -> RunConfig:
    """``cfg`` with another run directory."""
    return dataclasses.replace(cfg, run_dir=run_dir)
