"""``distaccum train`` with ``ft.groups``: a torchft Lighthouse and one launcher per replica group on this machine,
a dead group's launcher started again (it then heals from a live group and goes on at the run's current step).

Each group is its own world of ``trainer.nproc`` ranks (its own TCPStore, its own run directory
``run_dir/groups/g<i>-a<attempt>``, ``REPLICA_GROUP_ID`` and ``TORCHFT_LIGHTHOUSE`` in its environment); only the
Lighthouse and torchft's process group across groups join them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distaccum.cluster import forked
from distaccum.cluster.base import Launcher, World
from distaccum.cluster.local import WORKER_COMMAND, free_ports, worker_environment
from distaccum.config import RunConfig, to_mapping
from distaccum.runtime.stopping import EXIT_REQUEUE

GROUP_ENV, LIGHTHOUSE_ENV = "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE"
""":mod:`distaccum.ft.session`'s names (asked of every ``distaccum train``, this module imports no torch)."""
EXIT_CONFIG = 2
"""A worker's exit for a configuration it refused (``distaccum.cli.exitcodes``; the entry layer's, not imported)."""
RESTART_ENV = "DISTACCUM_FT_RESTART"
"""How many times this group's launcher was started again (0: the first start; :mod:`distaccum.ft.session`'s name)."""


def lighthouse_line(cfg: RunConfig) -> str:
    """What the run's console says about the Lighthouse and the groups."""
    ft = cfg.ft
    return (
        f"ft: {ft.groups} replica groups of {cfg.trainer.nproc} rank(s), a Lighthouse on this machine (min_replicas="
        f"{ft.min_groups}, heartbeat_timeout_ms={ft.heartbeat_timeout_ms}); a dead group restarted up to ft.restarts="
        f"{ft.restarts} time(s), healing from a live one"
    )


def lighthouse_argv(cfg: RunConfig, bind: str = "[::]:29510") -> list[str]:
    """The ``torchft_lighthouse`` command of ``cfg``'s settings (a Lighthouse started apart from the groups)."""
    ft = cfg.ft
    return [
        "torchft_lighthouse",
        f"--bind={bind}",
        f"--min_replicas={ft.min_groups}",
        f"--join_timeout_ms={ft.join_timeout_ms}",
        f"--quorum_tick_ms={ft.quorum_tick_ms}",
        f"--heartbeat_timeout_ms={ft.heartbeat_timeout_ms}",
    ]


def split_lines(cfg: RunConfig) -> list[str]:
    """K for each count of groups a quorum may admit (the window is cut for the groups present)."""
    ft = cfg.ft
    if cfg.accum.auto:
        return []
    split = cfg.split(cfg.trainer.nproc)
    per = split.micro_batch * split.world_size
    if any(split.global_batch % (per * n) for n in range(ft.min_groups, ft.groups + 1)):
        return []  # no K for some count of groups: check() says which multiple
    ks = ", ".join(
        f"K={split.global_batch // (per * n)} with {n}" for n in range(ft.groups, ft.min_groups - 1, -1)
    )
    return [
        f"ft: {split.global_batch} samples per step in micro-batches of {split.micro_batch} over {ft.groups} groups "
        f"of {split.world_size} rank(s): {ks} group(s) present"
    ]


class FtLauncher(Launcher):
    """``distaccum train`` with ``ft.groups``: the Lighthouse and one launcher per replica group on this machine
    (:func:`launch_ft`), in place of torch elastic."""

    name = "ft"
    summary = "this machine: a torchft Lighthouse and one launcher per replica group (ft.groups)"
    trains = True

    @staticmethod
    def takes(cfg: RunConfig) -> bool:
        return cfg.ft.enabled

    @staticmethod
    def world(cfg: RunConfig) -> World:
        """Every group's ranks, on this machine."""
        return World(cfg.trainer.nproc * max(cfg.ft.groups, 1), 1)

    @staticmethod
    def train_lines(cfg: RunConfig, config_file: Path) -> list[str]:
        return split_lines(cfg)

    @staticmethod
    def render(cfg: RunConfig, overrides: Sequence[str]) -> str:
        """What ``distaccum train`` starts: the Lighthouse, then each group's ranks with its own id and store."""
        lines = [*split_lines(cfg), shlex.join(lighthouse_argv(cfg, "[::]:0"))]
        for i in range(max(cfg.ft.groups, 1)):
            lines.append(
                f"{GROUP_ENV}={i} {LIGHTHOUSE_ENV}=http://<this host>:<port> "
                + shlex.join(
                    [*WORKER_COMMAND, str(Path(cfg.run_dir) / "groups" / f"g{i}-a0" / "launch_config.json")]
                )
                + f"  # x{cfg.trainer.nproc} rank(s); restarted up to ft.restarts={cfg.ft.restarts} time(s)"
            )
        return "".join(f"{line}\n" for line in lines)

    @staticmethod
    def launch(cfg: RunConfig, config_file: Path) -> int:
        return launch_ft(cfg)


@dataclass
class Group:
    """One replica group's launch: its ranks' processes, restarted whole when one of them dies."""

    index: int
    attempt: int = 0
    procs: list[Any] = field(default_factory=list)
    done: bool = False
    stopped: bool = False
    """It stopped on request (exit 3, after checkpointing): the run is rerun to resume, not restarted here."""

    def run_dir(self, cfg: RunConfig) -> Path:
        return Path(cfg.run_dir) / "groups" / f"g{self.index}-a{self.attempt}"

    def start(self, cfg: RunConfig, lighthouse: str) -> None:
        """Start the group's ranks (forked from distaccum's worker server when there is one)."""
        run_dir = self.run_dir(cfg)
        run_dir.mkdir(parents=True, exist_ok=True)
        if (
            self.attempt
        ):  # a restarted group resumes its own newest checkpoint (then heals if the others are ahead)
            first = Path(cfg.run_dir) / "groups" / f"g{self.index}-a0" / "checkpoints"
            first.mkdir(parents=True, exist_ok=True)
            link = run_dir / "checkpoints"
            if not link.exists():
                link.symlink_to(first.resolve(), target_is_directory=True)
        config = run_dir / "launch_config.json"
        config.write_text(json.dumps({**to_mapping(cfg), "run_dir": str(run_dir)}, indent=2) + "\n")
        nproc, port = cfg.trainer.nproc, free_ports(1)[0]
        base = {**os.environ, **worker_environment(nproc)}
        base.update(
            {
                GROUP_ENV: str(self.index),
                "NUM_REPLICA_GROUPS": str(cfg.ft.groups),
                LIGHTHOUSE_ENV: lighthouse,
                RESTART_ENV: str(self.attempt),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
            }
        )
        argv = [*WORKER_COMMAND, str(config)]
        self.procs = []
        for rank in range(nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            if forked.started():
                ctx = multiprocessing.get_context("forkserver")
                proc: Any = ctx.Process(target=forked.run_forked, args=forked.worker_args(argv[2:], env))
                proc.start()
            else:
                proc = subprocess.Popen([sys.executable, *argv], env=env)
            self.procs.append(proc)

    def codes(self) -> list[int | None]:
        return [p.exitcode if hasattr(p, "exitcode") else p.poll() for p in self.procs]

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the group's live ranks."""
        for p, code in zip(self.procs, self.codes(), strict=True):
            if code is None:
                os.kill(p.pid, sig)

    def kill(self) -> None:
        for p in self.procs:
            if (p.exitcode if hasattr(p, "exitcode") else p.poll()) is None:
                os.kill(p.pid, signal.SIGKILL)


def check(cfg: RunConfig) -> None:
    """ValueError for what cannot form replica groups, before any group starts (each group's set-up checks again)."""
    from distaccum.ft.setup import refusal

    ft, why = cfg.ft, refusal(cfg)
    if why is not None:
        raise ValueError(f"ft.groups={ft.groups}: {why}")
    if cfg.trainer.node_range()[1] > 1:
        raise ValueError(
            f"ft.groups={ft.groups}: distaccum train starts every group on this machine; on several "
            "nodes start each group as its own job (docs/failures.md)"
        )
    if not cfg.accum.auto:
        split = cfg.split(cfg.trainer.nproc)
        ft.check_split(split.global_batch, split.micro_batch, cfg.trainer.nproc)


def launch_ft(cfg: RunConfig) -> int:
    """Start the Lighthouse (unless ``ft.lighthouse`` names one) and every group; restart a group whose rank died;
    return 0 when every group finished, 1 otherwise (2: a configuration that cannot form groups)."""
    ft = cfg.ft
    try:
        check(cfg)
    except ValueError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    server = None
    address = ft.lighthouse
    # torchft's Rust side (Lighthouse, manager server) logs every tick at INFO to stderr: warnings only on the
    # console; its Python loggers go to each group's torchft.log (distaccum.ft.session.route_logging).
    os.environ.setdefault("RUST_LOG", "warn")
    if not address:
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(
            bind="[::]:0",
            min_replicas=ft.min_groups,
            join_timeout_ms=ft.join_timeout_ms,
            quorum_tick_ms=ft.quorum_tick_ms,
            heartbeat_timeout_ms=ft.heartbeat_timeout_ms,
        )
        address = server.address()
    print(f"distaccum: {lighthouse_line(cfg)}; Lighthouse at {address}", flush=True)
    groups = [Group(i) for i in range(ft.groups)]
    for group in groups:
        group.start(cfg, address)

    def forward(
        signum: int, frame: Any
    ) -> None:  # every group stops after the same window, checkpoints, exits 3
        for group in groups:
            group.signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        return _watch(cfg, groups, address)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for group in groups:
            group.kill()
        if server is not None:
            server.shutdown()


def _watch(cfg: RunConfig, groups: list[Group], address: str) -> int:
    ended: float | None = None  # when the first group finished the run's steps
    while not all(g.done for g in groups):
        time.sleep(0.1)
        if ended is not None and time.monotonic() - ended > cfg.ft.timeout_s:
            # The others finished trainer.max_steps: a group still running now is one that rejoined too late.
            late = [g.index for g in groups if not g.done]
            print(
                f"distaccum: ft: the run ended; replica group(s) {late} were still joining and are stopped",
                flush=True,
            )
            return 0
        for group in groups:
            if group.done:
                continue
            codes = group.codes()
            if all(c == 0 for c in codes):
                group.done = True
                ended = ended if ended is not None else time.monotonic()
                continue
            failed = [c for c in codes if c not in (0, None)]
            if not failed:
                continue
            if EXIT_REQUEUE in failed:  # stopped on request after a checkpoint: rerun the command to resume
                group.done = group.stopped = all(c is not None for c in codes)
                continue
            group.kill()
            if EXIT_CONFIG in failed:  # its set-up refused the run: a restart would refuse it again
                return EXIT_CONFIG
            if group.attempt >= cfg.ft.restarts:
                print(
                    f"distaccum: ft: replica group {group.index} failed (exit {failed[0]}), no restart left "
                    f"(ft.restarts={cfg.ft.restarts})",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            group.attempt += 1
            print(
                f"distaccum: ft: replica group {group.index} died (exit {failed[0]}); restarting it (restart "
                f"{group.attempt} of ft.restarts={cfg.ft.restarts}): it heals from a live group",
                flush=True,
            )
            group.start(cfg, address)
    return EXIT_REQUEUE if any(g.stopped for g in groups) else 0
