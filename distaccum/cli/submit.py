"""``distaccum submit [overrides] [--config-dir DIR] [--dry-run]``: render the sbatch script, submit it,
print the job id."""

from __future__ import annotations

import argparse
import sys

from distaccum.cli.compose import compose_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cluster.slurm import SlurmError, job_world_size, submit
from distaccum.config import ConfigError
from distaccum.preflight import preflight


def submit_main(argv: list[str]) -> int:
    """Parse ``argv``, compose and pre-flight the config, submit (or print the script with --dry-run)."""
    parser = argparse.ArgumentParser(
        prog="distaccum submit", description="Render an sbatch script from the config and submit it."
    )
    parser.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    parser.add_argument(
        "overrides", nargs="*", help="Hydra overrides (and --config-dir DIR), as for `distaccum train`"
    )
    args, unknown = parser.parse_known_args(argv)
    overrides = [*unknown, *args.overrides]
    try:
        cfg = compose_config(overrides)
        preflight(cfg, job_world_size(cfg), write=not args.dry_run, nodes=cfg.slurm.nodes)
    except ConfigError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    # The job's workers compose the same overrides; run_dir is pinned to this resolved value.
    overrides = [o for o in overrides if not o.startswith("run_dir=")]
    try:
        result = submit(cfg, overrides, dry_run=args.dry_run, python=sys.executable)
    except ValueError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    except SlurmError as err:
        print(f"distaccum: {err}", file=sys.stderr)
        return EXIT_FAIL
    if args.dry_run:
        print(result.script, end="")
        return EXIT_OK
    print(f"distaccum: wrote {result.script_path}; outputs go to {cfg.run_dir}", file=sys.stderr)
    print(result.job_id)
    return EXIT_OK
