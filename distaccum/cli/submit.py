"""``distaccum submit [--to slurm|kubeflow|ray] [overrides] [--config-dir DIR] [--dry-run]``: pre-flight the config
for the cluster's world, then hand the run to it — an sbatch script (Slurm, the default), a TrainJob (Kubeflow
Trainer) or Ray Train's TorchTrainer. ``--dry-run`` prints what would be submitted and submits nothing. The targets
are the launchers of :data:`distaccum.cluster.LAUNCHERS` that submit."""

from __future__ import annotations

import argparse
import sys

from distaccum.cli.compose import compose_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.helptext import config_keys
from distaccum.cluster import launcher_class, launchers
from distaccum.cluster.base import LaunchError
from distaccum.config import ConfigError
from distaccum.preflight import preflight

DEFAULT_TARGET = "slurm"


def _keys_help() -> str:
    """The cluster sections' keys, for ``--help``."""
    targets = launchers(submits=True)
    lines = ["targets (--to):"]
    lines += [f"  {launcher.name:<10}{launcher.summary}" for launcher in targets]
    lines += ["", "keys of each target (override as for `distaccum train`, e.g. slurm.nodes=4):"]
    for launcher in targets:
        if launcher.section is not None:
            lines += config_keys(*launcher.section)
    lines += [
        "",
        "exit codes: 0 submitted (or printed); 1 the cluster refused it; 2 bad input, before anything is submitted.",
        "docs: docs/clusters.md (Slurm, Kubeflow, Ray, several nodes); every key: docs/configuration.md",
    ]
    return "\n".join(lines)


def submit_main(argv: list[str]) -> int:
    """Parse ``argv``, compose and pre-flight the config, submit (or print what would be submitted)."""
    parser = argparse.ArgumentParser(
        prog="distaccum submit",
        description="Pre-flight the config for the target's world, then hand the run to the target (--to, below).",
        epilog=_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    targets = [launcher.name for launcher in launchers(submits=True)]
    parser.add_argument(
        "--to", choices=targets, default=DEFAULT_TARGET, help=f"where the run goes (default {DEFAULT_TARGET})"
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be submitted; submit nothing"
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides (and --config-dir DIR), as for `distaccum train`"
    )
    args, unknown = parser.parse_known_args(argv)
    overrides = [*unknown, *args.overrides]
    launcher = launcher_class(args.to)
    try:
        cfg = compose_config(overrides)
        world = launcher.world(cfg)
        preflight(cfg, world.ranks, write=not args.dry_run, nodes=world.nodes)
    except ConfigError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        if args.dry_run:
            print(launcher.render(cfg, overrides), end="")
            return EXIT_OK
        submitted = launcher.submit(cfg, overrides)
    except ValueError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except LaunchError as err:
        print(f"distaccum: {err}", file=sys.stderr)
        return EXIT_FAIL
    if submitted.note:
        print(f"distaccum: {submitted.note}", file=sys.stderr)
    print(submitted.out)
    return EXIT_OK
