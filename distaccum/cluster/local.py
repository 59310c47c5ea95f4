"""Local launch: render the torchrun-equivalent recipe (pure), then execute it with torch elastic.

``distaccum train`` on a login node or laptop becomes ``trainer.nproc`` workers on this machine (and
``trainer.nnodes`` > 1 joins a c10d rendezvous at ``trainer.rdzv_endpoint``), with exactly the
environment contract of ``torchrun``. ``trainer.nnodes=MIN:MAX`` is torchrun's elastic launch: the group
restarts on the nodes it has when one is lost (up to ``trainer.max_restarts`` times) or joins, and the
workers resume from the last checkpoint on the new world at the same global batch.
Each worker runs ``python -m distaccum _worker CONFIG``;
``distaccum verify --script`` launches a user's own script the same way.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaccum.cluster import forked
from distaccum.cluster.base import Launcher, World
from distaccum.config import RunConfig
from distaccum.rundir import LAUNCH_CONFIG
from distaccum.runtime.contracts import parse_nnodes
from distaccum.runtime.stopping import EXIT_REQUEUE

DISTACCUM_MODULE = ["-m", "distaccum"]
WORKER_COMMAND = [*DISTACCUM_MODULE, "_worker"]
KEEP_ALIVE_S = 5
KEEP_ALIVE_MISSES = 3
"""A node is dead to the rendezvous after this many missed keep-alives (torch's defaults, 5 s x 3)."""


@dataclass(frozen=True)
class LaunchRecipe:
    """Where and how many workers start (torchrun's arguments)."""

    nnodes: int | str
    """N nodes, or 'MIN:MAX' for an elastic launch."""
    nproc: int
    rdzv_endpoint: str
    rdzv_id: str
    max_restarts: int
    run_dir: str
    """Named in messages (where the checkpoint and the logs are)."""
    shutdown_grace_s: int = 30
    """Seconds workers get to exit after SIGTERM before they are killed."""
    rdzv_last_call_s: int = 30
    """Elastic launches: seconds a rendezvous with MIN nodes waits for more before it completes."""

    def node_range(self) -> tuple[int, int]:
        """(MIN, MAX) nodes; MIN < MAX for an elastic launch."""
        return parse_nnodes(self.nnodes)


PORT_RESERVATIONS = "distaccum-ports"
"""A folder in the temporary directory: one file per port :func:`free_ports` handed out lately, on this machine."""
RESERVATION_S = 600.0
"""How long a handed-out port stays reserved for the process that asked for it."""


def free_ports(count: int = 1) -> list[int]:
    """``count`` different TCP ports free on 127.0.0.1, for a rendezvous or a daemon started next.

    A port probed free and bound later is a race on a shared machine: a port the kernel picks (``bind`` to port 0,
    every outgoing connection) comes from its ephemeral range, so the next process's connection or listener may
    take it in between. These ports are drawn below that range instead, where the kernel never hands ports out,
    and each is reserved on this machine for :data:`RESERVATION_S` (a file created exclusively in
    :data:`PORT_RESERVATIONS`), so that two callers at once (two launches, two test workers) never get the same
    one; a port still bound by anything else is skipped."""
    low, _ = _ephemeral_range()
    first, last = 20000, min(low, 65536) - 1
    if last - first < 1000:  # an unusual range: draw above it instead
        first, last = _ephemeral_range()[1] + 1, 65535
    folder = Path(tempfile.gettempdir()) / PORT_RESERVATIONS
    folder.mkdir(exist_ok=True)
    chosen: list[int] = []
    draws = random.Random()  # seeded from the OS: two processes draw differently
    for _ in range(50 * count):
        if len(chosen) == count:
            return chosen
        port = draws.randint(first, last)
        if port not in chosen and _reserve(folder / str(port)) and _bindable(port):
            chosen.append(port)
    raise OSError(f"no free port found in {first}-{last} after {50 * count} tries")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _reserve(path: Path) -> bool:
    """Create ``path`` exclusively, or take it over once its reservation expired."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime < RESERVATION_S:
                return False
            os.utime(
                path
            )  # expired: renew it for this caller (two at once: both may, the bind check decides)
            return True
        except OSError:
            return False


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def launch_recipe(cfg: RunConfig) -> LaunchRecipe:
    """Single node: a free local port (like ``torchrun --standalone``); multi-node: the configured one."""
    endpoint = cfg.trainer.rdzv_endpoint if cfg.trainer.node_range()[1] > 1 else "127.0.0.1:0"
    return LaunchRecipe(
        cfg.trainer.nnodes,
        cfg.trainer.nproc,
        endpoint,
        cfg.trainer.rdzv_id,
        cfg.trainer.max_restarts,
        cfg.run_dir,
        cfg.trainer.shutdown_grace_s,
        cfg.trainer.rdzv_last_call_s,
    )


def worker_args(config_file: Path) -> list[str]:
    """The worker command line after the interpreter: ``-m distaccum _worker CONFIG``."""
    return [*WORKER_COMMAND, str(config_file)]


def torchrun_argv(recipe: LaunchRecipe, args: Sequence[str], *, python: str = sys.executable) -> list[str]:
    """The torchrun command equivalent to :func:`launch` (shown to users, used by tests)."""
    low, high = recipe.node_range()
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={recipe.nnodes}",
        f"--nproc_per_node={recipe.nproc}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={recipe.rdzv_endpoint}",
        f"--rdzv_id={recipe.rdzv_id}",
        *([f"--rdzv_conf=last_call_timeout={recipe.rdzv_last_call_s}"] if low < high else []),
        f"--max_restarts={recipe.max_restarts}",
        *args,
    ]


def elastic_lines(cfg: RunConfig) -> list[str]:
    """What an elastic launch (``trainer.nnodes=MIN:MAX``) may do, for the console; empty for a fixed one."""
    low, high = cfg.trainer.node_range()
    if low == high:
        return []
    worlds = cfg.world_sizes()
    if cfg.accum.auto:
        split = f"micro_batch auto, measured on each world, x the steps that follow = {cfg.global_batch()}"
    else:
        ks = ", ".join(f"K={cfg.split(w).accum_steps} on world {w}" for w in worlds)
        split = f"micro_batch {cfg.accum.micro_batch} x {ks} = {cfg.global_batch()}"
    every = cfg.trainer.checkpoint_every
    lost = (
        f"up to {every} optimizer step(s) redone"
        if every
        else "no periodic checkpoint: every step since the last redone"
    )
    restarts = cfg.trainer.max_restarts
    lines = [
        f"elastic: {low} to {high} nodes x {cfg.trainer.nproc} process(es): the world may be "
        f"{', '.join(map(str, worlds[:-1]))} or {worlds[-1]} ranks; {split} samples per optimizer step on each",
        f"elastic: a node lost mid-run (noticed within {KEEP_ALIVE_S * KEEP_ALIVE_MISSES} s, then "
        f"trainer.rdzv_last_call_s={cfg.trainer.rdzv_last_call_s} s for others to join): the rest resume from the "
        f"last checkpoint (trainer.checkpoint_every={every}: {lost}), at most trainer.max_restarts={restarts} "
        "time(s); a node joining restarts the group from its checkpoint with it",
        f"elastic: the node at trainer.rdzv_endpoint={cfg.trainer.rdzv_endpoint} hosts the rendezvous (on one "
        "host: the launcher that started first): losing that node ends the run",
    ]
    lines.append(
        f"elastic: waiting now at the rendezvous for {low} node(s), then up to trainer.rdzv_last_call_s="
        f"{cfg.trainer.rdzv_last_call_s} s more for up to {high} before the workers start"
    )
    if restarts == 0:
        lines.append(
            "elastic: trainer.max_restarts=0: a node lost mid-run ends the run (the range only lets it start "
            "with fewer nodes and grow); set trainer.max_restarts>=1 to continue without it"
        )
    return lines


def worker_environment(nproc: int) -> dict[str, str]:
    """Variables the launcher sets for its workers (only the launcher writes the environment)."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    env = {
        # Elastic restarts re-rendezvous reliably only without the shared agent store (gloo
        # connectFullMesh refused 5 of 8 restarts here with it; 0 of 4 without).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        # nproc workers share the cores; default OpenMP pools would oversubscribe them.
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads)),
        "PYTHONUNBUFFERED": "1",
    }
    if not os.environ.get("DS_ACCELERATOR") and not _has_cuda():
        # DeepSpeed (its engine, and Accelerate when saving a model) otherwise warns on every rank
        # that it "was unable to detect" a GPU: on a CPU-only machine there is none to detect.
        env["DS_ACCELERATOR"] = "cpu"
    return env


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def launch(recipe: LaunchRecipe, args: Sequence[str], extra_env: Mapping[str, str] | None = None) -> int:
    """Start ``recipe.nproc`` workers running ``python ARGS`` through torch elastic, and wait.

    Returns 0, 1 when a worker failed, or 3 when the run stopped on request after checkpointing.
    """
    saved = dict(os.environ)
    os.environ.update(worker_environment(recipe.nproc))  # elastic passes this process's env to the workers
    os.environ.update(extra_env or {})
    try:
        return _run_elastic(recipe, list(args))
    finally:  # several launches from one process (verify, sweeps) must not inherit each other's
        os.environ.clear()
        os.environ.update(saved)


def launch_local(cfg: RunConfig, config_file: Path) -> int:
    """Start ``cfg``'s workers (``python -m distaccum _worker CONFIG``) and wait; see :func:`launch`."""
    return launch(launch_recipe(cfg), worker_args(config_file))


def _run_elastic(recipe: LaunchRecipe, args: list[str]) -> int:
    # distaccum's own workers, launched by its command line: forked from the server it started (cluster/forked.py)
    fork = args[: len(DISTACCUM_MODULE)] == DISTACCUM_MODULE and forked.started()
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    grace: dict[str, Any] = {"shutdown_timeout": recipe.shutdown_grace_s}
    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        # torch < 2.13 (outside distaccum's tested versions, e.g. a GPU image's own torch): torch's own grace applies
        print(
            f"distaccum: this torch's LaunchConfig has no shutdown_timeout; workers get torch's default grace "
            f"after SIGTERM, not trainer.shutdown_grace_s={recipe.shutdown_grace_s} "
            "(distaccum is tested on torch>=2.13)",
            file=sys.stderr,
        )
        grace = {}
    low, high = recipe.node_range()
    # last_call_timeout: how long a rendezvous that has MIN nodes waits for up to MAX (only elastic ones wait).
    rdzv = {
        "timeout": 900,
        "join_timeout": 900,
        "last_call_timeout": recipe.rdzv_last_call_s,
        "keep_alive_interval": KEEP_ALIVE_S,
        "keep_alive_max_attempt": KEEP_ALIVE_MISSES,
    }
    config = LaunchConfig(
        min_nodes=low,
        max_nodes=high,
        nproc_per_node=recipe.nproc,
        run_id=recipe.rdzv_id,
        rdzv_backend="c10d",
        rdzv_endpoint=recipe.rdzv_endpoint,
        rdzv_configs=rdzv,
        max_restarts=recipe.max_restarts,
        monitor_interval=0.1,
        start_method="forkserver" if fork else "spawn",
        **grace,
    )
    try:
        if fork:
            elastic_launch(config, forked.run_forked)(*forked.worker_args(args[len(DISTACCUM_MODULE) :]))
        else:
            elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as err:
        codes = {f.exitcode for f in err.failures.values()}
        if codes == {EXIT_REQUEUE}:
            print(
                f"distaccum: stopped on request; checkpoint in {recipe.run_dir}; "
                "rerun the same command to resume",
                file=sys.stderr,
            )
            return EXIT_REQUEUE
        failures = ", ".join(f"rank {r}: exit {f.exitcode}" for r, f in sorted(err.failures.items()))
        print(f"distaccum: worker(s) failed ({failures})", file=sys.stderr)
        return 2 if codes == {2} else 1
    except SignalException as err:
        # SIGTERM/SIGINT reached this launcher: torch elastic forwarded SIGTERM to the workers,
        # which finish the window in progress and checkpoint before exiting.
        print(
            f"distaccum: launcher got {err.sigval.name}; workers checkpoint at the next window "
            f"boundary in {recipe.run_dir}; rerun the same command to resume",
            file=sys.stderr,
        )
        return EXIT_REQUEUE
    return 0


def start_worker_server(cfg: RunConfig) -> None:
    """Start the server that ``cfg``'s local workers fork from (:func:`forked.start`), with its engine's imports."""
    from distaccum.engines import worker_imports

    forked.start(worker_imports(cfg.engine.name))


class LocalLauncher(Launcher):
    """``distaccum train``'s launcher (torch elastic on this machine, and a node of a multi-node run), and the
    default of ``distaccum verify --to``: :func:`launch_local` runs each candidate."""

    name = "local"
    summary = "this machine (and a node of several): torch elastic"
    verifies = True
    trains = True
    launch = staticmethod(launch_local)
    prepare = staticmethod(start_worker_server)  # the workers' libraries load while verify's reference runs

    @staticmethod
    def world(cfg: RunConfig) -> World:
        """The largest world ``cfg`` may get (an elastic ``trainer.nnodes=MIN:MAX`` starts with fewer nodes)."""
        nodes = cfg.trainer.node_range()[1]
        return World(cfg.trainer.nproc * nodes, nodes)

    @staticmethod
    def render(cfg: RunConfig, overrides: Sequence[str]) -> str:
        """The torchrun command equivalent to the launch (``overrides`` are resolved into the launch config)."""
        argv = torchrun_argv(launch_recipe(cfg), worker_args(Path(cfg.run_dir) / LAUNCH_CONFIG))
        return "".join(f"distaccum: {line}\n" for line in elastic_lines(cfg)) + shlex.join(argv) + "\n"

    @staticmethod
    def train_lines(cfg: RunConfig, config_file: Path) -> list[str]:
        """The torchrun command equivalent to ``distaccum train``'s launch."""
        return [f"equivalent to `{shlex.join(torchrun_argv(launch_recipe(cfg), worker_args(config_file)))}`"]
