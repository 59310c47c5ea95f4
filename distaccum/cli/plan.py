"""``distaccum plan [overrides] [--run] [--sweep]``: every split of the global batch, its predicted step
time, communication share and peak memory, and a recommendation (:mod:`distaccum.tuning.planner`).

The measurements run on the configured world (``trainer.nproc`` local workers, like ``train``);
rank 0 writes ``plan.json``, this process prints the table and writes ``plan.md``. ``--run`` then
trains the recommended split; ``--sweep`` writes ``sweep.sh``, the Hydra multirun that measures every
split that fits, for ``distaccum report``. Exit codes: 0 ok, 1 a worker failed, 2 bad input.

``--nodes N --gpus-per-node G --inter-node-gbps B --intra-node-gbps B`` adds a prediction for that
cluster: every engine and sync mode, from the measured compute of a micro-batch (or ``--compute-ms``,
given: then nothing is measured) and the α–β model of the collectives (:mod:`distaccum.tuning.scaleout`).
``--island-link-gbps B`` or ``--outer-every H`` adds the outer sync of islands joined by that link (DiLoCo,
LocalSGD): the smallest H that hides it behind the islands' steps (:mod:`distaccum.tuning.outer_plan`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distaccum.cli.compose import compose_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.helptext import plain_text
from distaccum.cli.plan_cluster import (  # noqa: F401 - measured_cluster and train_command are used by tests too
    CLUSTER_ONLY,
    OUTER_ONLY,
    add_cluster_flags,
    add_outer_flags,
    check_cluster_flags,
    cluster_commands,
    cluster_of,
    cluster_workload,
    measured_cluster,
    outer_wanted,
    predict_cluster,
    train_command,
    user_overrides,
)
from distaccum.cli.worker import worker_exit
from distaccum.config import ConfigError, RunConfig, from_mapping, to_mapping
from distaccum.preflight import instantiate_components, preflight
from distaccum.rundir import PLAN, PLAN_TABLE, SWEEP_SCRIPT, read_json
from distaccum.runtime.contracts import DistEnv
from distaccum.tuning.scaleout import cluster_accum_steps

if TYPE_CHECKING:
    pass

PLAN_CONFIG = "plan_config.json"


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The plan's own flags, and the config overrides (everything else)."""
    parser = argparse.ArgumentParser(
        prog="distaccum plan",
        description=plain_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--run", action="store_true", help="then train the recommended split")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="write run_dir/sweep.sh: the multirun measuring every split that fits",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="timing rounds per micro-batch size (default 5)"
    )
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per size and round (default 2)")
    parser.add_argument(
        "--trial-accum",
        type=int,
        default=4,
        help="accumulation steps of a timing trial; larger K are extrapolated (default 4)",
    )
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="time one size after another (default on CUDA) instead of interleaving rounds",
    )
    add_cluster_flags(parser)
    add_outer_flags(parser)
    args, overrides = parser.parse_known_args(argv)
    for value, name in (
        (args.rounds, "--rounds"),
        (args.steps, "--steps"),
        (args.trial_accum, "--trial-accum"),
    ):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    given = [f"--{k.replace('_', '-')}" for k in CLUSTER_ONLY if getattr(args, k) is not None]
    if args.nodes is None and given:
        parser.error(f"{', '.join(given)} describe a cluster: give --nodes too")
    outer_given = [f"--{k.replace('_', '-')}" for k in OUTER_ONLY if getattr(args, k) is not None]
    if outer_given and not outer_wanted(args):
        parser.error(
            f"{', '.join(outer_given)} describe an outer sync: give --island-link-gbps or --outer-every too"
        )
    if args.compute_ms is not None and (args.run or args.sweep):
        parser.error(
            "--compute-ms predicts without measuring this machine: it does not combine with --run or --sweep"
        )
    return args, overrides


def given_compute(args: argparse.Namespace, overrides: list[str]) -> int:
    """``--nodes ... --compute-ms X``: the prediction without measuring anything (exit code)."""
    try:
        check_cluster_flags(args)
        cfg = compose_config(overrides)
        params = (
            int(args.params)
            if args.params
            else sum(p.numel() for p in preflight(cfg, write=False).model.parameters())
        )
        micro = cfg.accum.micro_batch if isinstance(cfg.accum.micro_batch, int) else None
        accum_steps = cluster_accum_steps(
            micro,
            cluster_of(args, need_links=False).topology.world,
            global_batch=cfg.accum.global_batch,
            steps=cfg.accum.steps,
            given_steps=args.accum_steps,
        )
        work = cluster_workload(
            args,
            params,
            args.compute_ms / 1e3,
            "given with --compute-ms: an assumption, not measured here",
            accum_steps,
        )
        print(predict_cluster(args, work, micro, cfg.accum.global_batch), flush=True)
        if micro is not None:  # run_dir as given, else a name of its own (the default is a time stamp)
            given = any(o.startswith("run_dir=") for o in overrides)
            commands = cluster_commands(
                args, overrides, micro, work, cfg.run_dir if given else "runs/cluster"
            )
            print("\n" + "\n".join(commands), flush=True)
    except (ConfigError, ValueError) as err:
        print(f"distaccum plan: {err}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_OK


def plan_main(argv: list[str]) -> int:
    """Entry of ``distaccum plan``; returns the exit code."""
    from distaccum.cluster.local import launch, launch_recipe
    from distaccum.tuning.growth_plan import render_phases
    from distaccum.tuning.planner import SplitPlan, render_table

    try:
        args, overrides = parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.compute_ms is not None:
        return given_compute(args, overrides)
    try:
        if args.nodes is not None:
            check_cluster_flags(args)
        cfg = compose_config(overrides)
        checked = preflight(cfg)
    except (ConfigError, ValueError) as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        return EXIT_CONFIG
    run_dir = Path(cfg.run_dir)
    options = {
        "rounds": args.rounds,
        "steps": args.steps,
        "trial_accum": args.trial_accum,
        "interleaved": False if args.sequential else None,
    }
    config_file = run_dir / PLAN_CONFIG
    config_file.write_text(json.dumps({"config": to_mapping(cfg), "options": options}, indent=2) + "\n")
    names = checked.components.describe()
    global_batch = checked.run.split.global_batch
    print(
        f"distaccum plan: {names['model']} on {names['dataset']}, {cfg.engine.name} x{checked.run.split.world_size} "
        f"ranks, global batch {global_batch}: measuring every micro-batch size, run_dir {run_dir}",
        flush=True,
    )
    code = launch(launch_recipe(cfg), ["-m", "distaccum", "_plan", str(config_file)])
    if code:
        print(
            f"distaccum plan: the measuring workers failed (exit {code}); see their output above",
            file=sys.stderr,
        )
        return code
    plan = SplitPlan.from_dict(read_json(run_dir / PLAN))
    table = render_table(plan)
    fitting = [p.split.micro_batch for p in plan.predictions if p.fits]
    sweep = train_command(
        overrides, global_batch, ",".join(map(str, fitting)), str(run_dir / "sweep"), multirun=True
    )
    lines = [
        f"budget {plan.budget_bytes / 2**20:.0f} MiB per rank ({plan.memory}); times are medians of "
        f"{args.rounds} x {args.steps} steps per micro-batch size at K <= {args.trial_accum}, larger K "
        "extrapolated",
        "",
        table,
        "",
    ]
    rec = plan.recommended
    if rec is None:
        lines.append("no split fits the memory budget: raise accum.memory_budget or use a smaller model")
    else:
        lines.append(f"recommended: accum.micro_batch={rec.micro_batch} (K={rec.accum_steps})")
        lines.append(
            "train it:      "
            + shlex.join(
                train_command(
                    overrides, global_batch, str(rec.micro_batch), str(run_dir / "train"), multirun=False
                )
            )
        )
    lines.append(
        "measure all:   " + shlex.join(sweep) + f" && distaccum report {shlex.quote(str(run_dir / 'sweep'))}"
    )
    growth = checked.run.data.growth
    if growth is not None:  # a ramp's (or the adaptive batch's) K per phase, from the same coefficients
        micro = rec.micro_batch if cfg.accum.auto and rec is not None else int(checked.run.split.micro_batch)
        world = checked.run.split.world_size
        adaptive = cfg.accum.adaptive
        bounds = adaptive.bounds(micro * world, global_batch) if adaptive.enabled else None
        lines += ["", render_phases(growth, plan.costs, micro, world, cfg.trainer.max_steps, bounds)]
    if args.nodes is not None:
        params = int(args.params or sum(p.numel() for p in checked.model.parameters()))
        given = any(o.lstrip("+~").startswith("accum.micro_batch=") for o in overrides)
        fixed = int(checked.run.split.micro_batch) if given and not cfg.accum.auto else None
        cluster = measured_cluster(
            args,
            plan,
            cfg.engine.name,
            params,
            cfg.accum.global_batch,
            fixed_micro_batch=fixed,
            overrides=overrides,
            run_dir=str(run_dir / "cluster"),
        )
        lines += ["", cluster]
    text = "\n".join(lines)
    (run_dir / PLAN_TABLE).write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    if args.sweep:
        script = run_dir / SWEEP_SCRIPT
        script.write_text(
            "#!/bin/sh\n# every split that fits, then the report (written by distaccum plan)\nset -e\n"
            + shlex.join(sweep)
            + "\n"
            + shlex.join(["distaccum", "report", str(run_dir / "sweep")])
            + "\n"
        )
        script.chmod(0o755)
        print(f"wrote {script}", flush=True)
    if args.run and rec is not None:
        command = [
            sys.executable,
            "-m",
            *train_command(
                overrides, global_batch, str(rec.micro_batch), str(run_dir / "train"), multirun=False
            ),
        ]
        return subprocess.run(command, check=False).returncode
    return EXIT_OK if rec is not None or not args.run else EXIT_FAIL


def plan_worker(config_file: str) -> None:
    """One measuring rank (``python -m distaccum _plan CONFIG``), started by :func:`plan_main`."""

    def run() -> None:
        import torch.distributed as dist

        from distaccum.rundir import write_json
        from distaccum.runtime.procgroup import ensure_process_group, pick_device
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
