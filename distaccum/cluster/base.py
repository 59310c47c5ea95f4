"""The launcher protocol: what each entry of :data:`distaccum.cluster.LAUNCHERS` does with a config.

A launcher knows the world a config asks of its target (:meth:`Launcher.world`, which the pre-flight checks before
anything starts), renders what it would hand the target (:meth:`Launcher.render`: an sbatch script, a TrainJob, a
Ray recipe, a command line; pure, no cluster needed, what ``--dry-run`` prints), and hands it over
(:meth:`Launcher.submit`
for ``distaccum submit --to NAME``, :meth:`Launcher.launch` for ``distaccum verify --to NAME``'s candidates). What a
launcher can do is said on its class (``submits``, ``verifies``), never by its name elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

if (
    TYPE_CHECKING
):  # distaccum.config imports this package's config sections: at run time the names stay strings
    from distaccum.config import RunConfig


class LaunchError(RuntimeError):
    """The target refused the run or failed it, or its tools are missing; the message says which and what to do
    (``distaccum submit`` exits 1; a bad configuration is a ValueError instead, exit 2)."""


@dataclass(frozen=True)
class World:
    """The ranks and nodes a launcher starts for a config (the pre-flight checks the split for it)."""

    ranks: int
    nodes: int


@dataclass(frozen=True)
class Submitted:
    """What :meth:`Launcher.submit` did."""

    out: str
    """For stdout: what names the job (a Slurm job id, kubectl's answer, the run's result)."""
    note: str = ""
    """For stderr: where its files went."""


class Launcher:
    """One target of ``distaccum submit --to`` or ``distaccum verify --to``; subclasses override what they support.

    Launchers keep no state: the registry hands out the class, whose methods are static.
    """

    name: ClassVar[str]
    """The registry key (``--to NAME``)."""
    summary: ClassVar[str]
    """What it hands the target, in a few words (``distaccum submit --help``)."""
    section: ClassVar[tuple[str, type] | None] = None
    """Its config section (key, class) when it has one: ``distaccum submit --help`` lists the keys."""
    submits: ClassVar[bool] = False
    """A target of ``distaccum submit --to``: implements :meth:`submit`."""
    verifies: ClassVar[bool] = False
    """A target of ``distaccum verify --to``: implements :meth:`launch`."""
    trains: ClassVar[bool] = False
    """Starts ``distaccum train``'s run on this machine (implements :meth:`train_lines` and :meth:`launch`): ``local``
    (torch elastic) every config that no entry of :data:`~distaccum.cluster.TRAINS` :meth:`takes`."""

    @staticmethod
    def takes(cfg: RunConfig) -> bool:
        """Whether ``distaccum train`` starts ``cfg`` with this launcher (asked only of :data:`TRAINS`' entries)."""
        return False

    @staticmethod
    def train_lines(cfg: RunConfig, config_file: Path) -> list[str]:
        """What ``distaccum train``'s console says about the launch before it starts (each line after
        ``distaccum: ``)."""
        return []

    @staticmethod
    def world(cfg: RunConfig) -> World:
        """The world ``cfg`` asks of this target; ValueError when the target cannot run it."""
        raise NotImplementedError

    @staticmethod
    def render(cfg: RunConfig, overrides: Sequence[str]) -> str:
        """The dry run: what would be handed to the target, as text, with the lines it ends in (pure: writes
        nothing, starts nothing). ``overrides``: what ``cfg`` was composed from, for the job to compose again."""
        raise NotImplementedError

    @staticmethod
    def submit(cfg: RunConfig, overrides: Sequence[str]) -> Submitted:
        """Hand the run to the target (``cfg`` pre-flighted at :meth:`world`); raises :class:`LaunchError`."""
        raise NotImplementedError

    @staticmethod
    def prepare(cfg: RunConfig) -> None:
        """Before ``distaccum verify`` runs its reference: get ready to launch ``cfg``'s candidates (nothing unless
        overridden)."""

    @staticmethod
    def launch(cfg: RunConfig, config_file: Path) -> int:
        """Run one of ``distaccum verify``'s candidates and wait: 0 finished, 1 failed (the error printed).
        ``config_file``: the candidate's resolved configuration, as written for the workers."""
        raise NotImplementedError


class JobLauncher(Launcher):
    """A launcher that renders a job from its config section and hands it to the cluster's tool (sbatch, kubectl):
    the world is the job's ranks (``world_size``) over the section's ``nodes``."""

    section: ClassVar[tuple[str, type]]
    submits = True

    @staticmethod
    def world_size(cfg: RunConfig) -> int:
        """The ranks the job starts for ``cfg`` (ValueError when the target cannot run it)."""
        raise NotImplementedError

    @classmethod
    def world(cls, cfg: RunConfig) -> World:
        return World(cls.world_size(cfg), getattr(cfg, cls.section[0]).nodes)
