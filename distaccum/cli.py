"""The ``distaccum`` console script: the only place with argv, Hydra and exit codes.

    distaccum train  [hydra overrides] [--multirun]   launch local workers (or run as one rank
                                                       when started by torchrun / srun)
    distaccum verify [hydra overrides]                compare against a single-process reference
    distaccum report RUN_DIR [RUN_DIR ...] [--out DIR] tables and plots of finished runs / sweeps
    distaccum submit [hydra overrides] [--dry-run]    render an sbatch script and submit it

Exit codes: 0 success, 1 failure (a worker failed, or verify found a mismatch), 2 bad config.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

from distaccum.config import ConfigError, RunConfig, from_mapping, to_mapping
from distaccum.topology import DistEnv, is_worker

if TYPE_CHECKING:
    from distaccum.checkpoint import StopFlag

EXIT_OK, EXIT_FAIL, EXIT_CONFIG = 0, 1, 2
EXIT_REQUEUE = 3  # == distaccum.checkpoint.EXIT_REQUEUE (not imported here: it pulls in torch)
USAGE = __doc__ or ""


def config_dir() -> Path:
    """``$DISTACCUM_CONFIG_DIR``, else the repository's ``configs/`` next to the package."""
    override = os.environ.get("DISTACCUM_CONFIG_DIR")
    path = Path(override) if override else Path(__file__).resolve().parents[1] / "configs"
    if not (path / "config.yaml").is_file():
        raise SystemExit(f"distaccum: no config.yaml in {path}; set DISTACCUM_CONFIG_DIR")
    return path


def register_defaults() -> None:
    """Offer every field's dataclass default to Hydra as the ``distaccum_defaults`` node.

    ``configs/config.yaml`` lists it first, so every field can be overridden from the command line
    (Hydra's struct mode still rejects unknown keys) while the YAML files only select and override.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="distaccum_defaults", node=to_mapping(RunConfig()))


def to_run_config(dcfg: Any, run_dir: str | None = None) -> RunConfig:
    """OmegaConf -> RunConfig at the boundary; raises ValueError for any invalid value or split."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        values = OmegaConf.to_container(dcfg, resolve=True)
        assert isinstance(values, dict)
        values.pop("hydra", None)
        if run_dir is not None:
            values["run_dir"] = run_dir
        cfg = from_mapping(values)
        cfg.split()  # validates the split for the launch's world size (suggests valid ones)
    except (ValueError, OmegaConfBaseException) as err:
        raise ConfigError(str(err)) from err
    return cfg


def _config_error(err: Exception) -> NoReturn:
    print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)


def _hydra_job(task: Callable[[Any], int]) -> Callable[[], Any]:
    """Wrap ``task`` as a Hydra app over ``configs/`` (gives --multirun, --cfg job, sweeps)."""
    import hydra

    register_defaults()

    @hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="config")
    def app(dcfg: Any) -> int:
        return task(dcfg)

    return app


def _in_multirun() -> tuple[bool, str | None]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return hc.mode == RunMode.MULTIRUN, hc.runtime.output_dir


def _write_status(run_dir: str, status: str, **fields: Any) -> None:
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    (path / "status.json").write_text(json.dumps({"status": status, **fields}, indent=2) + "\n")


def _train_task(dcfg: Any) -> int:
    """One Hydra job: validate, then start the workers. In a sweep, failures are recorded, not raised."""
    from distaccum.launcher import launch_local, torchrun_argv

    multirun, job_dir = _in_multirun()
    try:
        cfg = to_run_config(dcfg, run_dir=job_dir if multirun else None)
    except ValueError as err:
        if not multirun:
            _config_error(err)
        print(f"distaccum: skipping invalid split in sweep job {job_dir}: {err}", file=sys.stderr)
        _write_status(str(job_dir), "invalid_config", error=str(err))
        return EXIT_CONFIG
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    config_file = Path(cfg.run_dir) / "launch_config.json"
    config_file.write_text(json.dumps(to_mapping(cfg), indent=2) + "\n")
    split = cfg.split()
    print(f"distaccum: {cfg.engine.name} x{split.world_size} ranks, micro_batch {split.micro_batch} x "
          f"{split.accum_steps} accumulation steps = {split.global_batch} samples per optimizer step, "
          f"run_dir {cfg.run_dir}", flush=True)
    print("distaccum: equivalent to `" + shlex.join(torchrun_argv(cfg, config_file)) + "`", flush=True)
    code = launch_local(cfg, config_file)
    _write_status(cfg.run_dir, "ok" if code == EXIT_OK else "failed", exit_code=code)
    if code and not multirun:
        raise SystemExit(code)
    return code


def _stop_flag() -> StopFlag:
    """SIGTERM / SIGUSR1 ask the run to checkpoint after the window in progress and stop."""
    from distaccum.checkpoint import StopFlag

    flag = StopFlag()
    flag.install()
    return flag


def _worker_exit(run: Callable[[], Any]) -> NoReturn:
    """Run one rank, then tear down and leave with ``os._exit``.

    A clean exit means: barrier, destroy the process group, flush, and skip interpreter shutdown —
    letting Python finalize while gloo threads still free tensors aborted FSDP runs now and then
    ("terminate called without an active exception").
    """
    from distaccum.checkpoint import StopRequested
    from distaccum.worker import shutdown

    code = EXIT_OK
    try:
        run()
    except StopRequested as stopped:
        print(f"distaccum: {stopped}; rerun the same command to resume", file=sys.stderr)
        code = EXIT_REQUEUE
    except ConfigError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        code = EXIT_CONFIG
    except BaseException:  # noqa: BLE001 - report every failure of this rank, then exit non-zero
        traceback.print_exc()
        code = EXIT_FAIL
    try:
        if code in (EXIT_OK, EXIT_REQUEUE):
            shutdown()
        else:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _worker_from_file(config_file: str) -> NoReturn:
    """A rank spawned by our own launcher: the resolved config comes as a JSON file."""
    from distaccum.worker import run_worker

    cfg = from_mapping(json.loads(Path(config_file).read_text()))
    _worker_exit(lambda: run_worker(cfg, DistEnv.from_environ(os.environ), _stop_flag()))


def _worker_in_place(overrides: list[str]) -> NoReturn:
    """A rank started by torchrun or srun: compose the config, agree on rank 0's copy, train."""

    def run() -> None:
        import torch.distributed as dist

        from distaccum.worker import init_process_group, pick_device, run_worker

        env = DistEnv.from_environ(os.environ)
        cfg = compose_config(overrides)
        init_process_group(env, pick_device(cfg, env))
        # Ranks resolve ${now:...} at slightly different times: everyone uses rank 0's config.
        shared = [to_mapping(cfg)]
        dist.broadcast_object_list(shared, src=0)
        cfg = from_mapping(shared[0])
        try:
            cfg.split(dist.get_world_size())
        except ValueError as err:
            raise ConfigError(str(err)) from err
        run_worker(cfg, env, _stop_flag())

    _worker_exit(run)


def compose_config(overrides: list[str]) -> RunConfig:
    """Compose ``configs/`` with ``overrides`` outside a Hydra app (workers in place, submit)."""
    from hydra import compose, initialize_config_dir

    register_defaults()
    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        try:
            dcfg = compose(config_name="config", overrides=overrides)
        except Exception as err:  # hydra's composition errors share no public base class
            raise ConfigError(str(err)) from err
    return to_run_config(dcfg)


def _run_hydra(command: str, rest: list[str], task: Callable[[Any], int]) -> None:
    """Run ``task`` as a Hydra app. Hydra exits 1 on composition errors (an unknown engine or
    model group, a malformed override) before the task runs: those are config errors, exit 2."""
    started = False

    def tracked(dcfg: Any) -> int:
        nonlocal started
        started = True
        return task(dcfg)

    sys.argv = [f"distaccum {command}", *rest]
    try:
        _hydra_job(tracked)()
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
    command, rest = args[0], args[1:]
    if command == "_worker":
        _worker_from_file(rest[0])
    elif command == "train":
        if is_worker(os.environ):
            _worker_in_place(rest)
        _run_hydra(command, rest, _train_task)
    elif command == "verify":
        from distaccum.verify_cli import verify_task

        _run_hydra(command, rest, verify_task)
    elif command == "report":
        from distaccum.report_cli import report_main

        raise SystemExit(report_main(rest))
    elif command == "submit":
        from distaccum.submit_cli import submit_main

        raise SystemExit(submit_main(rest))
    else:
        print(f"distaccum: unknown command {command!r}\n{USAGE}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG)
