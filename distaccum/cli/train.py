"""``distaccum train``: validate and pre-flight the config, then start the local workers (or, under
torchrun/srun, run as one rank). In a Hydra sweep every job is recorded, failures included."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from distaccum.cli.compose import to_run_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_OK
from distaccum.config import to_mapping, with_overrides
from distaccum.outer.islands import island_lines
from distaccum.preflight import preflight
from distaccum.rundir import LAUNCH_CONFIG, STATUS, write_json
from distaccum.runtime.contracts import node_launch
from distaccum.runtime.topology import placement_lines


def in_multirun() -> tuple[bool, str | None]:
    """Whether this Hydra job is part of a sweep, and its output directory."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN, hc.runtime.output_dir


def config_error(err: Exception) -> None:
    """Print a configuration error as one paragraph and exit 2."""
    print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)


def train_task(dcfg: Any) -> int:
    """One Hydra job: validate and pre-flight, then start the workers."""
    from distaccum.cluster import train_launcher
    from distaccum.cluster.local import elastic_lines, start_worker_server

    multirun, job_dir = in_multirun()
    try:
        cfg = to_run_config(dcfg, run_dir=job_dir if multirun else None)
        launch = node_launch(os.environ)  # a Kubeflow TrainJob's pod: the cluster sets the topology
        if launch is not None:
            print(f"distaccum: {launch.describe()}", flush=True)
            cfg = with_overrides(cfg, launch.overrides())
        # The workers' libraries load in a server forked from here, beside the pre-flight: forked before it, while
        # this process has only imported and parsed (the pre-flight instantiates the user's components).
        start_worker_server(cfg)
        checked = preflight(cfg)
    except ValueError as err:  # ConfigError, or a PET_* value the config refuses
        if not multirun:
            config_error(err)
        print(f"distaccum: skipping invalid sweep job {job_dir}: {err}", file=sys.stderr)
        write_json(Path(str(job_dir)) / STATUS, {"status": "invalid_config", "error": str(err)})
        return EXIT_CONFIG
    config_file = Path(cfg.run_dir) / LAUNCH_CONFIG
    config_file.write_text(json.dumps(to_mapping(cfg), indent=2) + "\n")
    split = checked.run.split
    names = checked.components.describe()
    how = (
        "micro_batch auto (measured by the workers) x the accumulation steps that follow"
        if cfg.accum.auto
        else f"micro_batch {split.micro_batch} x {split.accum_steps} accumulation steps"
    )
    worlds = cfg.world_sizes()
    if len(worlds) > 1:  # elastic: K follows the world the run gets (elastic_lines lists them)
        how = f"micro_batch {cfg.accum.micro_batch} x the accumulation steps of the world it gets"
    ranks = f"x{split.world_size}" if len(worlds) == 1 else f"on {worlds[0]} to {worlds[-1]}"
    batch = f"{how} = {split.global_batch} samples per optimizer step"
    launcher = train_launcher(cfg)  # torch elastic, or a feature's own launch (distaccum.cluster.TRAINS)
    if launcher.name != "local":  # its own launch: its lines below say how the ranks split the window
        ranks, how = f"on {launcher.world(cfg).ranks}", f"micro_batch {split.micro_batch} x K (below)"
        batch = f"{how} = {split.global_batch} samples per optimizer step"
    growth = checked.run.data.growth
    if cfg.accum.adaptive.enabled and growth is not None:  # the phases follow (describe_growth, rank 0)
        batch = f"a global batch from {growth.phases[0][1]} chosen as it runs (accum.adaptive), micro_batch {split.micro_batch}"
    elif growth is not None and len(growth.phases) > 1:
        batch = (
            f"a global batch ramping {growth.phases[0][1]} -> {growth.phases[-1][1]} (accum.ramp), micro_batch "
            f"{split.micro_batch} x the accumulation steps of each phase"
        )
    print(
        f"distaccum: {names['model']} on {names['dataset']}, {cfg.engine.name} {ranks} ranks, {batch}, "
        f"run_dir {cfg.run_dir}",
        flush=True,
    )
    for line in launcher.train_lines(cfg, config_file):
        print(f"distaccum: {line}", flush=True)
    nodes = cfg.trainer.node_range()[1]  # an elastic launch: its largest world (elastic_lines says the rest)
    for line in placement_lines(checked.run.engine.replicas, nodes, cfg.trainer.nproc):
        print(f"distaccum: {line}", flush=True)
    for line in island_lines(checked.run.outer_islands, nodes, cfg.trainer.nproc):
        print(f"distaccum: {line}", flush=True)
    for line in elastic_lines(cfg):
        print(f"distaccum: {line}", flush=True)
    code = launcher.launch(cfg, config_file)
    if nodes > 1:  # every node's launcher says how its own workers ended (rank 0's node also printed "done")
        print(
            f"distaccum: this node's workers exited {code} ({'ok' if code == EXIT_OK else 'failed'})",
            flush=True,
        )
    write_json(
        Path(cfg.run_dir) / STATUS, {"status": "ok" if code == EXIT_OK else "failed", "exit_code": code}
    )
    if code and not multirun:
        raise SystemExit(code)
    return code
