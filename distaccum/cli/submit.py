"""``distaccum submit [--to slurm|kubeflow|ray] [overrides] [--config-dir DIR] [--dry-run]``: pre-flight the config
for the cluster's world, then hand the run to it — an sbatch script (Slurm, the default), a TrainJob (Kubeflow
Trainer) or Ray Train's TorchTrainer. ``--dry-run`` prints what would be submitted and submits nothing."""

from __future__ import annotations

import argparse
import sys

from distaccum.cli.compose import compose_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.helptext import config_keys
from distaccum.cluster import kubeflow, ray_train, slurm
from distaccum.cluster.config import KubeflowConfig, RayConfig, SlurmConfig
from distaccum.config import ConfigError, RunConfig
from distaccum.preflight import preflight

TARGETS = ("slurm", "kubeflow", "ray")


def _world(target: str, cfg: RunConfig) -> tuple[int, int]:
    """(ranks, nodes) of the job the target will run."""
    if target == "slurm":
        return slurm.job_world_size(cfg), cfg.slurm.nodes
    if target == "kubeflow":
        return kubeflow.kubeflow_world_size(cfg), cfg.kubeflow.nodes
    return ray_train.ray_world_size(cfg), int(cfg.trainer.nnodes)  # ray_world_size refuses MIN:MAX


def _keys_help() -> str:
    """The cluster sections' keys, for ``--help``."""
    sections = [("slurm", SlurmConfig), ("kubeflow", KubeflowConfig), ("ray", RayConfig)]
    lines = ["keys of each target (override as for `distaccum train`, e.g. slurm.nodes=4):"]
    for name, cls in sections:
        lines += config_keys(name, cls)
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
        description="Pre-flight the config, then submit it to Slurm (an sbatch script), Kubernetes (a Kubeflow "
        "Trainer TrainJob) or Ray (Ray Train's TorchTrainer).",
        epilog=_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--to", choices=TARGETS, default="slurm", help="where the run goes (default slurm)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be submitted; submit nothing"
    )
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides (and --config-dir DIR), as for `distaccum train`"
    )
    args, unknown = parser.parse_known_args(argv)
    overrides = [*unknown, *args.overrides]
    try:
        cfg = compose_config(overrides)
        world, nodes = _world(args.to, cfg)
        preflight(cfg, world, write=not args.dry_run, nodes=nodes)
    except ConfigError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        if args.to == "slurm":
            return _slurm(cfg, overrides, args.dry_run)
        if args.to == "kubeflow":
            return _kubeflow(cfg, overrides, args.dry_run)
        return ray_train.submit_ray(cfg, overrides, dry_run=args.dry_run)
    except ValueError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except (slurm.SlurmError, kubeflow.KubeflowError) as err:
        print(f"distaccum: {err}", file=sys.stderr)
        return EXIT_FAIL


def _slurm(cfg: RunConfig, overrides: list[str], dry_run: bool) -> int:
    # The job's workers compose the same overrides; run_dir is pinned to this resolved value.
    overrides = [o for o in overrides if not o.startswith("run_dir=")]
    result = slurm.submit(cfg, overrides, dry_run=dry_run, python=sys.executable)
    if dry_run:
        print(result.script, end="")
        return EXIT_OK
    print(f"distaccum: wrote {result.script_path}; outputs go to {cfg.run_dir}", file=sys.stderr)
    print(result.job_id)
    return EXIT_OK


def _kubeflow(cfg: RunConfig, overrides: list[str], dry_run: bool) -> int:
    result = kubeflow.submit_trainjob(cfg, overrides, dry_run=dry_run)
    if dry_run:
        print(result.manifest, end="")
        return EXIT_OK
    print(
        f"distaccum: wrote {result.path} and applied it; outputs go to {kubeflow.pod_run_dir(cfg)} in the pods",
        file=sys.stderr,
    )
    print(result.applied or "")
    return EXIT_OK
