"""One rank of ``distaccum train``: started by distaccum's own launcher (config file) or in place by
``torchrun`` / ``srun`` (Hydra overrides). Both instantiate the components and drive the public
:class:`~distaccum.trainer.Trainer` — the same object a user's own script uses."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn

from distaccum.cli.compose import compose_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK, EXIT_REQUEUE
from distaccum.cli.startup import resume as resume_collection
from distaccum.cluster.forked import leave
from distaccum.config import ConfigError, RunConfig, from_mapping, to_mapping
from distaccum.preflight import instantiate_components, preflight
from distaccum.rundir import Record
from distaccum.runtime.contracts import DistEnv


def stop_flag() -> Any:
    """SIGTERM / SIGUSR1 ask the run to checkpoint after the window in progress and stop."""
    from distaccum.runtime.stopping import StopFlag

    flag = StopFlag()
    flag.install()
    return flag


def train_rank(cfg: RunConfig, *, check_components: bool) -> Record:
    """Instantiate ``cfg``'s components in this process and train this rank."""
    import torch._dynamo  # noqa: F401 - DDP's constructor and torch's optimizers import it: here, uncollected

    from distaccum.trainer import Trainer

    # The libraries are loaded; from here on the collector runs, so that nothing the set-up leaves behind (the auto
    # micro-batch's probe models) outlives it.
    resume_collection()
    parts = instantiate_components(cfg)
    return Trainer.of(cfg, parts, stop=stop_flag(), check_components=check_components).fit()


def worker_exit(run: Callable[[], Any]) -> None:
    """Run one rank, then leave the process group and exit with ``os._exit``.

    Skipping interpreter shutdown matters: letting Python finalize while gloo threads still free
    tensors aborted FSDP runs now and then ("terminate called without an active exception").
    A rank forked by distaccum's launcher that succeeded returns instead (:func:`distaccum.cluster.forked.leave`).
    """
    from distaccum.runtime.procgroup import shutdown
    from distaccum.runtime.stopping import StopRequested

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
        shutdown(clean=code in (EXIT_OK, EXIT_REQUEUE))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        leave(code)


def worker_from_file(config_file: str) -> None:
    """A rank started by distaccum's launcher: the resolved, pre-flight-checked config comes as JSON."""
    cfg = from_mapping(json.loads(Path(config_file).read_text()))
    worker_exit(lambda: train_rank(cfg, check_components=False))


def worker_in_place(argv: list[str]) -> NoReturn:
    """A rank started by torchrun or srun: compose, let rank 0 check everything, agree on its config."""

    def run() -> None:
        import torch.distributed as dist

        from distaccum.runtime.procgroup import ensure_process_group, pick_device

        env = DistEnv.from_environ(os.environ)
        cfg = compose_config(argv)
        ensure_process_group(env, pick_device(cfg.trainer.device, env))
        # Ranks resolve ${now:...} at slightly different times: everyone uses rank 0's config, and
        # rank 0's pre-flight verdict, so a bad component fails every rank the same way.
        shared: list[Any] = [to_mapping(cfg), None]
        if dist.get_rank() == 0:
            try:
                preflight(cfg, dist.get_world_size(), nodes=env.nodes)
            except ConfigError as err:
                shared[1] = str(err)
        dist.broadcast_object_list(shared, src=0)
        if shared[1] is not None:
            raise ConfigError(shared[1])
        train_rank(from_mapping(shared[0]), check_components=False)

    worker_exit(run)
    raise SystemExit(EXIT_OK)  # not reached: torchrun and srun start ranks as new processes, which exit above
