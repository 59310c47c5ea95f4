"""The ``distaccum`` console script: the only place with argv, Hydra and exit codes.

One module per subcommand (``train``, ``verify``, ``plan``, ``report``, ``submit``, ``bugzoo``), shared exit codes
(:mod:`~distaccum.cli.exitcodes`), Hydra composition (:mod:`~distaccum.cli.compose`), component
instantiation and pre-flight checks. The library below never imports this package.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from distaccum import __version__
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.startup import pause as pause_collection
from distaccum.cli.startup import resume as resume_collection
from distaccum.runtime.contracts import ContractError, recognize

USAGE = """\
usage: distaccum <command> [options] [overrides]

Distributed PyTorch training with gradient accumulation: one gradient reduction per optimizer
step, the loss divided by the global item count of the step, verified against one process.

commands:
  train   [overrides] [--config-dir DIR] [--multirun]  train on local workers (or as one rank under
                                                        torchrun / srun); the trained model is kept
  verify  [overrides] [--to ray]                       compare a run step by step with a single-process
          --script FILE [--nproc N] [-- ARGS]          reference (a config, or your own Trainer script)
  plan    [overrides] [--run] [--sweep]                predict step time, comm share and peak memory of
                                                        every split of the global batch; recommend one
  report  RUN_DIR [RUN_DIR ...] [--out DIR]            tables and plots of finished runs and sweeps
  submit  [--to slurm|kubeflow|ray] [overrides]        submit to Slurm (sbatch), Kubernetes (a Kubeflow TrainJob)
          [--dry-run]                                  or Ray Train; --dry-run prints what would be submitted
  bugzoo  [run_dir=DIR] [--only NAME,...] [--list]     inject known accumulation bugs into real runs: what
                                                        catches each one, and is the diagnosis right

Overrides use Hydra's syntax: key=value (accum.micro_batch=8), group=option (model=mlp),
+new.key=value. Your own model, data and loss: a directory with model/, data/ and loss/ groups
(_target_ nodes), passed with --config-dir.

examples:
  distaccum train                                   tiny_gpt on the embedded corpus, DDP, 2 workers
  distaccum train model=mlp accum.global_batch=64 accum.micro_batch=8 trainer.max_steps=100
  distaccum train --config-dir ./conf model=mytask data=mytask loss=mytask
  distaccum train model=hf_causal_lm data=text_files  a Hugging Face causal LM on local text (distaccum[hf])
  distaccum verify engine=fsdp precision=fp64
  distaccum plan model=mlp accum.global_batch=64        which micro-batch x accumulation steps is fastest
  distaccum train accum.micro_batch=auto accum.global_batch=64   the largest micro-batch that fits
  distaccum train --cfg job                         print the composed configuration
  distaccum train --help                            every config group and option

exit codes: 0 ok; 1 a worker failed or verify found a mismatch; 2 bad input (reported before any
worker starts); 3 stopped after a checkpoint (rerun the same command to resume).
docs: README.md, https://github.com/distaccum/distaccum"""


def precheck(argv: list[str]) -> None:
    """Compose plain overrides before Hydra runs, so a composition error or an unusable run_dir is one
    paragraph and exit 2 rather than Hydra's traceback. The run directory is created and written to
    here (Hydra would create it next): permission bits are no proof (as root ``/proc`` looks writable).
    Hydra's own flags (--multirun, --cfg, ...) are left to Hydra."""
    from distaccum.cli.compose import compose_config
    from distaccum.config import ConfigError
    from distaccum.preflight import check_run_dir

    if any(a.startswith("-") and not a.startswith("--config-dir") and a != "-cd" for a in argv):
        return
    try:
        check_run_dir(compose_config(argv).run_dir)
    except ConfigError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def config_dirs_first(argv: list[str]) -> list[str]:
    """``argv`` with ``--config-dir DIR`` / ``-cd DIR`` moved to the front: Hydra's argument parser takes
    no overrides after an option, so ``model=x --config-dir ./conf loss=y`` would fail."""
    dirs: list[str] = []
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg in ("--config-dir", "-cd"):
            dirs += [arg, next(it, "")]
        elif arg.startswith("--config-dir="):
            dirs.append(arg)
        else:
            rest.append(arg)
    return dirs + rest


def _run_hydra(command: str, rest: list[str], task: Callable[[Any], int]) -> None:
    """Run ``task`` as a Hydra app over the packaged configs (gives --multirun, --cfg, --config-dir).

    Hydra exits 1 on composition errors (an unknown group option, a malformed override) before the
    task runs: those are bad input, exit 2.
    """
    import hydra

    from distaccum.cli.compose import CONFIG_NAME, CONFIG_PATH, register_defaults

    register_defaults()
    started = False

    @hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name=CONFIG_NAME)
    def app(dcfg: Any) -> int:
        nonlocal started
        started = True
        resume_collection()  # the libraries are loaded, the config composed
        return task(dcfg)

    precheck(rest)
    sys.argv = [f"distaccum {command}", *config_dirs_first(rest)]
    try:
        app()
    except SystemExit as stop:
        if stop.code == EXIT_FAIL and not started:
            raise SystemExit(EXIT_CONFIG) from None
        raise


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``distaccum`` console script and ``python -m distaccum``."""
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        raise SystemExit(EXIT_OK if args else EXIT_CONFIG)
    if args[0] in ("-V", "--version", "version"):
        import torch

        print(f"distaccum {__version__} (torch {torch.__version__}, Python {sys.version.split()[0]})")
        raise SystemExit(EXIT_OK)
    command, rest = args[0], args[1:]
    if command in ("_worker", "train", "verify"):  # resumed once their task starts (cli.startup)
        pause_collection()
    if command == "_worker":
        from distaccum.cli.worker import worker_from_file

        worker_from_file(rest[0])
    elif command == "train":
        try:
            contract = recognize(os.environ)
        except ContractError as err:
            print(f"distaccum: {err}", file=sys.stderr)
            raise SystemExit(EXIT_CONFIG) from None
        if contract.is_worker:
            from distaccum.cli.worker import worker_in_place

            worker_in_place(rest)
        from distaccum.cli.train import train_task

        _run_hydra(command, rest, train_task)
    elif command == "_verify_script":
        from distaccum.cli.verify import verify_script_entry

        verify_script_entry(rest)
    elif command == "verify":
        from distaccum.cli.verify import verify_main

        raise SystemExit(verify_main(rest, lambda task, args: _run_hydra(command, args, task)))
    elif command == "plan":
        from distaccum.cli.plan import plan_main

        raise SystemExit(plan_main(rest))
    elif command == "_plan":
        from distaccum.cli.plan import plan_worker

        plan_worker(rest[0])
    elif command == "report":
        from distaccum.cli.report import report_main

        raise SystemExit(report_main(rest))
    elif command == "_bugzoo_worker":
        from distaccum.cli.bugzoo import bugzoo_worker

        bugzoo_worker(rest[0])
    elif command == "bugzoo":
        from distaccum.cli.bugzoo import bugzoo_main

        raise SystemExit(bugzoo_main(rest))
    elif command == "submit":
        from distaccum.cli.submit import submit_main

        raise SystemExit(submit_main(rest))
    else:
        print(f"distaccum: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
