"""Local launch: render the torchrun-equivalent plan (pure), then execute it with torch elastic.

``distaccum train`` on a login node or laptop becomes ``trainer.nproc`` workers on this machine (and
``trainer.nnodes`` > 1 joins a c10d rendezvous at ``trainer.rdzv_endpoint``), with exactly the
environment contract of ``torchrun``. Each worker runs ``python -m distaccum _worker CONFIG``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from distaccum.checkpoint import EXIT_REQUEUE
from distaccum.config import RunConfig

WORKER_COMMAND = ["-m", "distaccum", "_worker"]


def rdzv_endpoint(cfg: RunConfig) -> str:
    """Single node: a free local port (like ``torchrun --standalone``); multi-node: the configured one."""
    return cfg.trainer.rdzv_endpoint if cfg.trainer.nnodes > 1 else "127.0.0.1:0"


def torchrun_argv(cfg: RunConfig, config_file: Path, *, python: str = sys.executable) -> list[str]:
    """The torchrun command equivalent to :func:`launch_local` (shown to users, used by tests)."""
    return [
        python, "-m", "torch.distributed.run",
        f"--nnodes={cfg.trainer.nnodes}",
        f"--nproc_per_node={cfg.trainer.nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={rdzv_endpoint(cfg)}",
        f"--rdzv_id={cfg.trainer.rdzv_id}",
        f"--max_restarts={cfg.trainer.max_restarts}",
        *WORKER_COMMAND, str(config_file),
    ]


def worker_environment(cfg: RunConfig) -> dict[str, str]:
    """Variables the launcher sets for its workers (only the launcher writes the environment)."""
    threads = max(1, (os.cpu_count() or 1) // cfg.trainer.nproc)
    return {
        # Elastic restarts re-rendezvous reliably only without the shared agent store (gloo
        # connectFullMesh refused 5 of 8 restarts here with it; 0 of 4 without).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # nproc workers share the cores; default OpenMP pools would oversubscribe them.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
        "PYTHONUNBUFFERED": "1",
    }


def launch_local(cfg: RunConfig, config_file: Path) -> int:
    """Start the workers through torch elastic and wait.

    Returns 0, 1 when a worker failed, or 3 when the run stopped on request after checkpointing.
    """
    saved = dict(os.environ)
    os.environ.update(worker_environment(cfg))  # elastic passes this process's env to the workers
    try:
        return _run_elastic(cfg, config_file)
    finally:  # several launches from one process (verify, sweeps) must not inherit each other's
        os.environ.clear()
        os.environ.update(saved)


def _run_elastic(cfg: RunConfig, config_file: Path) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(
        min_nodes=cfg.trainer.nnodes,
        max_nodes=cfg.trainer.nnodes,
        nproc_per_node=cfg.trainer.nproc,
        run_id=cfg.trainer.rdzv_id,
        rdzv_backend="c10d",
        rdzv_endpoint=rdzv_endpoint(cfg),
        rdzv_configs={"timeout": 900, "join_timeout": 900},
        max_restarts=cfg.trainer.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        elastic_launch(launch, sys.executable)(*WORKER_COMMAND, str(config_file))
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes == {EXIT_REQUEUE}:
            print(f"distaccum: stopped on request; checkpoint in {cfg.run_dir}; "
                  "rerun the same command to resume", file=sys.stderr)
            return EXIT_REQUEUE
        failures = ", ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(err.failures.items()))
        print(f"distaccum: worker(s) failed ({failures})", file=sys.stderr)
        return 1
    except SignalException as err:
        # SIGTERM/SIGINT reached this launcher: torch elastic forwarded SIGTERM to the workers,
        # which finish the window in progress and checkpoint before exiting.
        print(f"distaccum: launcher got {err.sigval.name}; workers checkpoint at the next window "
              f"boundary in {cfg.run_dir}; rerun the same command to resume", file=sys.stderr)
        return EXIT_REQUEUE
    return 0
