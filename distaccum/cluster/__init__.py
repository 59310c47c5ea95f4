"""The launchers: where the workers run (this machine through torch elastic, Slurm, Kubeflow Trainer, Ray Train) and
their config sections, above the Trainer they start. The worker runtime below the Trainer is
:mod:`distaccum.runtime`.

Launcher modules are imported on first use (``importlib``), as engines are. Add a launcher with one module (a
:class:`~distaccum.cluster.base.Launcher` subclass), one line in :data:`LAUNCHERS` and its section of
docs/clusters.md; ``distaccum submit --to`` and ``distaccum verify --to`` offer it by its class's capabilities.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distaccum import load_entry
from distaccum.cluster.base import Launcher

if (
    TYPE_CHECKING
):  # distaccum.config imports this package's config sections: at run time the names stay strings
    from distaccum.config import RunConfig

LAUNCHERS: dict[str, str] = {
    "local": "distaccum.cluster.local:LocalLauncher",
    "slurm": "distaccum.cluster.slurm:SlurmLauncher",
    "kubeflow": "distaccum.cluster.kubeflow:KubeflowLauncher",
    "ray": "distaccum.cluster.ray_train:RayLauncher",
    "ft": "distaccum.ft.launch:FtLauncher",
}
"""Launcher name (``--to NAME``) -> ``module:Class``."""
TRAINS: tuple[str, ...] = ("ft",)
"""The launchers ``distaccum train`` asks, in order, whether they start a config on this machine
(:meth:`~distaccum.cluster.base.Launcher.takes`: a feature that launches its own way, such as ``ft``'s Lighthouse and
replica groups); ``local`` (torch elastic) starts the rest."""


def launcher_class(name: str) -> type[Launcher]:
    """The launcher registered under ``name`` (imports its module)."""
    if name not in LAUNCHERS:
        raise ValueError(f"--to {name!r} is not one of {', '.join(LAUNCHERS)}")
    launcher: type[Launcher] = load_entry(LAUNCHERS[name])
    assert launcher.name == name, (
        f"{LAUNCHERS[name]} is registered as {name!r} but names itself {launcher.name!r}"
    )
    return launcher


def train_launcher(cfg: RunConfig) -> type[Launcher]:
    """The launcher ``distaccum train`` starts ``cfg`` with on this machine: the first of :data:`TRAINS` that takes
    it, else ``local`` (imports only those)."""
    for name in TRAINS:
        launcher = launcher_class(name)
        if launcher.takes(cfg):
            return launcher
    return launcher_class("local")


def launchers(*, submits: bool = False, verifies: bool = False) -> list[type[Launcher]]:
    """Every registered launcher with the capabilities asked for, in registry order (imports them all)."""
    found = [launcher_class(name) for name in LAUNCHERS]
    return [c for c in found if (c.submits or not submits) and (c.verifies or not verifies)]
