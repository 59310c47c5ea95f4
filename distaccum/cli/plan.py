"""``distaccum plan [overrides] [--run] [--sweep]``: every split of the global batch, its predicted step
time, communication share and peak memory, and a recommendation (:mod:`distaccum.tuning.planner`).

The measurements run on the configured world (``trainer.nproc`` local workers, like ``train``);
rank 0 writes ``plan.json``, this process prints the table and writes ``plan.md``. ``--run`` then
trains the recommended split; ``--sweep`` writes ``sweep.sh``, the Hydra multirun that measures every
split that fits, for ``distaccum report``. Exit codes: 0 ok, 1 a worker failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

from distaccum.cli.compose import compose_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.worker import worker_exit
from distaccum.cluster.topology import DistEnv
from distaccum.config import ConfigError, RunConfig, from_mapping, to_mapping
from distaccum.preflight import instantiate_components, preflight
from distaccum.rundir import PLAN, PLAN_TABLE, SWEEP_SCRIPT, read_json

PLAN_CONFIG = "plan_config.json"
SPLIT_KEYS = ("accum.micro_batch", "accum.steps", "accum.global_batch", "run_dir")
"""Overrides the plan replaces in the commands it writes."""


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The plan's own flags, and the config overrides (everything else)."""
    parser = argparse.ArgumentParser(prog="distaccum plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="then train the recommended split")
    parser.add_argument("--sweep", action="store_true",
                        help="write run_dir/sweep.sh: the multirun measuring every split that fits")
    parser.add_argument("--rounds", type=int, default=5, help="timing rounds per micro-batch size (default 5)")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per size and round (default 2)")
    parser.add_argument("--trial-accum", type=int, default=4,
                        help="accumulation steps of a timing trial; larger K are extrapolated (default 4)")
    parser.add_argument("--sequential", action="store_true",
                        help="time one size after another (default on CUDA) instead of interleaving rounds")
    args, overrides = parser.parse_known_args(argv)
    for value, name in ((args.rounds, "--rounds"), (args.steps, "--steps"), (args.trial_accum, "--trial-accum")):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    return args, overrides


def user_overrides(overrides: list[str]) -> list[str]:
    """The user's overrides without the ones the plan sets (the split, the global batch, run_dir)."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] not in SPLIT_KEYS]


def train_command(overrides: list[str], global_batch: int, micro: str, run_dir: str, *, multirun: bool) -> list[str]:
    """``distaccum train [--multirun] ...`` for the given micro-batch value(s)."""
    return ["distaccum", "train", *(["--multirun"] if multirun else []), *user_overrides(overrides),
            f"accum.global_batch={global_batch}", f"accum.micro_batch={micro}", f"run_dir={run_dir}"]


def plan_main(argv: list[str]) -> int:
    """Entry of ``distaccum plan``; returns the exit code."""
    from distaccum.cluster.local import launch, launch_plan
    from distaccum.tuning.planner import SplitPlan, render_table

    try:
        args, overrides = parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        cfg = compose_config(overrides)
        checked = preflight(cfg)
    except ConfigError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = Path(cfg.run_dir)
    options = {"rounds": args.rounds, "steps": args.steps, "trial_accum": args.trial_accum,
               "interleaved": False if args.sequential else None}
    config_file = run_dir / PLAN_CONFIG
    config_file.write_text(json.dumps({"config": to_mapping(cfg), "options": options}, indent=2) + "\n")
    names = checked.components.describe()
    global_batch = checked.run.split.global_batch
    print(f"distaccum plan: {names['model']} on {names['dataset']}, {cfg.engine.name} x{checked.run.split.world_size} "
          f"ranks, global batch {global_batch}: measuring every micro-batch size, run_dir {run_dir}", flush=True)
    code = launch(launch_plan(cfg), ["-m", "distaccum", "_plan", str(config_file)])
    if code:
        print(f"distaccum plan: the measuring workers failed (exit {code}); see their output above", file=sys.stderr)
        return code
    plan = SplitPlan.from_dict(read_json(run_dir / PLAN))
    table = render_table(plan)
    fitting = [p.split.micro_batch for p in plan.predictions if p.fits]
    sweep = train_command(overrides, global_batch, ",".join(map(str, fitting)), str(run_dir / "sweep"), multirun=True)
    lines = [f"budget {plan.budget_bytes / 2**20:.0f} MiB per rank ({plan.memory}); times are medians of "
             f"{args.rounds} x {args.steps} steps per micro-batch size at K <= {args.trial_accum}, larger K "
             "extrapolated", "", table, ""]
    rec = plan.recommended
    if rec is None:
        lines.append("no split fits the memory budget: raise accum.memory_budget or use a smaller model")
    else:
        lines.append(f"recommended: accum.micro_batch={rec.micro_batch} (K={rec.accum_steps})")
        lines.append("train it:      " + shlex.join(train_command(overrides, global_batch, str(rec.micro_batch),
                                                                  str(run_dir / "train"), multirun=False)))
    lines.append("measure all:   " + shlex.join(sweep) + f" && distaccum report {shlex.quote(str(run_dir / 'sweep'))}")
    text = "\n".join(lines)
    (run_dir / PLAN_TABLE).write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    if args.sweep:
        script = run_dir / SWEEP_SCRIPT
        script.write_text("#!/bin/sh\n# every split that fits, then the report (written by distaccum plan)\nset -e\n"
                          + shlex.join(sweep) + "\n" + shlex.join(["distaccum", "report", str(run_dir / "sweep")]) + "\n")
        script.chmod(0o755)
        print(f"wrote {script}", flush=True)
    if args.run and rec is not None:
        command = [sys.executable, "-m", *train_command(overrides, global_batch, str(rec.micro_batch),
                                                        str(run_dir / "train"), multirun=False)]
        return subprocess.run(command, check=False).returncode
    return EXIT_OK if rec is not None or not args.run else EXIT_FAIL


def plan_worker(config_file: str) -> NoReturn:
    """One measuring rank (``python -m distaccum _plan CONFIG``), started by :func:`plan_main`."""

    def run() -> None:
        import torch.distributed as dist

        from distaccum.cluster.procgroup import ensure_process_group, pick_device
        from distaccum.rundir import write_json
        from distaccum.tuning.planner import plan_splits

        payload: dict[str, Any] = json.loads(Path(config_file).read_text())
        cfg: RunConfig = from_mapping(payload["config"])
        env = DistEnv.from_environ(os.environ)
        device = pick_device(cfg.trainer.device, env)
        ensure_process_group(env, device)
        parts = instantiate_components(cfg)
        plan = plan_splits(cfg, parts, device, env.local_world_size, Path(cfg.run_dir), **payload["options"])
        if dist.get_rank() == 0:
            write_json(Path(cfg.run_dir) / PLAN, plan.as_dict())

    worker_exit(run)
