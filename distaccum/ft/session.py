"""This replica group's torchft Manager: the quorum of each step, the sum across groups, the commit vote.

torchft (its ``Manager`` with a reconfigurable gloo process group across groups, and a ``Lighthouse`` that forms a
quorum of the live groups every step) is used with two choices of distaccum's own. The quorum is synchronous
(``use_async_quorum=False``): the groups present must be known before the step's window is cut, and a group that
heals loads a live group's state in the quorum and then sits that step out (the window is cut for the others), so
nothing it computes is thrown away. The
reduction is a SUM, never torchft's default average over the groups present: the loop divides by the window's
global item count N, which the same collective sums (:mod:`distaccum.loop` has the math).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from distaccum.ft.config import FtConfig

GROUP_ENV = "REPLICA_GROUP_ID"
"""The replica group of this process (torchft's examples' name; set by the launcher, :mod:`distaccum.ft.launch`)."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
RESTART_ENV = "DISTACCUM_FT_RESTART"
"""How many times this group was started again within the run (0 or unset: its first start; set by ``distaccum
train`` and by a rendered Slurm job's restart loop)."""
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


class FtError(RuntimeError):
    """A fault-tolerant run cannot go on: the message says why in one line and what to do."""


@dataclass(frozen=True)
class Quorum:
    """The groups one step's quorum admits, as this group sees them."""

    groups: int
    """Groups present (torchft's participants)."""
    index: int
    """This group's place among them (0-based): which pieces of the window it takes (-1: it sits the step out)."""
    quorum_s: float
    """Seconds this group waited for the quorum (and healed in it)."""
    healed: bool
    """This group loaded a live group's state in this quorum."""

    @property
    def sits_out(self) -> bool:
        """This group takes no pieces of the step (it healed in its quorum): the others' cut covers the window."""
        return self.index < 0


def route_logging(run_dir: Path) -> None:
    """torchft's Python loggers (INFO every step) to ``run_dir/torchft.log``, not the console."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(run_dir / "torchft.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in TORCHFT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False


def resolvable_host(cfg: FtConfig) -> str:
    """The host name this group advertises; FtError when it does not resolve (the other groups could not reach it)."""
    host = cfg.hostname or socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
    except OSError as err:
        raise FtError(
            f"ft: this host's name {host!r} does not resolve ({err.strerror}): the other replica groups could not "
            "reach it; set ft.hostname to a name or address they can (or add the name to /etc/hosts)"
        ) from None
    return host


class FtSession:
    """One replica group's side of torchft, for one rank of it (every rank of the group makes one).

    :meth:`start` builds the Manager once the run's state exists (the state a healing group loads), :meth:`quorum`
    begins a step, :meth:`all_reduce` sums (or takes the maximum of) a buffer over the groups present and
    :meth:`vote` is the vote of every group present on whether the step counts. An engine that sums the gradients
    itself joins it (:meth:`join`; exact accumulation: an :class:`~distaccum.exact.engine.AcrossGroups`)."""

    def __init__(self, cfg: FtConfig, group: int, group_rank: int, group_world: int, run_dir: Path) -> None:
        self.cfg, self.group, self.group_rank, self.group_world = cfg, group, group_rank, group_world
        self.run_dir = run_dir
        self.manager: Any = None
        self.step = 0
        """The 0-based optimizer step being computed (set by :meth:`quorum`)."""
        self.attempts = 0
        """Attempts of the current step so far (1 when the first one commits)."""
        self.committed = False
        self.last: Quorum | None = None
        self.resumed_at = 0
        """The step this group resumed from its checkpoint (0: a fresh start)."""
        self.started = False
        """A quorum has admitted this group (its first waits for every group at the run's start or resumed step)."""
        self.restarted = int(os.environ.get(RESTART_ENV) or 0) > 0
        """Started again within the run after it died: it joins the groups alive, whatever step it resumed."""
        self.carried: list[tuple[Callable[[], Any], Callable[[Any], None]]] = []
        """(state, load) of what a healing group loads beyond the run's state (an engine that joined: :meth:`join`)."""
        self.redoing = False
        """The step's window runs again in the same quorum (a redo: no vote was taken)."""
        self.sent_bytes = 0
        """Bytes this rank has put into reductions across groups so far (every attempt's)."""

    def lighthouse(self) -> str:
        """The Lighthouse's address: ``ft.lighthouse``, else the launcher's ``TORCHFT_LIGHTHOUSE``."""
        addr = self.cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not addr:
            raise FtError(
                "ft: no Lighthouse: set ft.lighthouse=http://host:port (start one with `torchft_lighthouse "
                f"--min_replicas {self.cfg.min_groups}`), or launch with `distaccum train`, which starts one"
            )
        return addr

    def start(self, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """Build this group's Manager over a reconfigurable gloo group across groups (collective inside the group:
        the group's rank 0 serves it, over the group's own TCPStore)."""
        # torchft's Rust side (the manager server) logs every tick at INFO on stderr; its logger reads RUST_LOG once,
        # when torchft is first imported: warnings only on the console, unless the user chose otherwise (a script
        # that imported torchft itself must set RUST_LOG before that import).
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft import Manager, ProcessGroupGloo

        route_logging(self.run_dir)
        cfg, addr = self.cfg, self.lighthouse()
        host = resolvable_host(cfg)
        timeout = timedelta(seconds=cfg.timeout_s)
        master = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "0"))
        try:
            self.manager = Manager(
                pg=ProcessGroupGloo(timeout=timeout),
                load_state_dict=load_state_dict,
                state_dict=state_dict,
                min_replica_size=cfg.min_groups,
                use_async_quorum=False,  # the window is cut for the quorum; a healing group loads before it
                timeout=timeout,
                quorum_timeout=timedelta(seconds=cfg.quorum_timeout_s),
                connect_timeout=timeout,
                rank=self.group_rank,
                world_size=self.group_world,
                store_addr=master[0],
                store_port=master[1],
                lighthouse_addr=addr,
                replica_id=f"distaccum_{self.group}",
                hostname=host,
                init_sync=False,  # every group builds the same initial model from the seed
                max_retries=cfg.max_retries,
            )
        except Exception as err:  # noqa: BLE001 - the Rust client's errors: one line that names the Lighthouse
            raise FtError(f"ft: the Lighthouse at {addr} is unreachable ({first_line(err)})") from None

    def resumed(self, step: int) -> None:
        """This group resumed ``step`` optimizer steps from its own checkpoint: the Manager counts from there (a group
        whose checkpoint is older heals from one at the newest step at its first quorum)."""
        self.manager.load_state_dict({"step": step, "batches_committed": step * self.cfg.groups})
        self.resumed_at = step

    def quorum(self, step: int) -> Quorum:
        """Begin computing 0-based step ``step`` (or compute it again): the quorum of the groups present. The first
        step waits for every group (none starts alone); a group behind the others heals from a live one here."""
        manager, cfg = self.manager, self.cfg
        # A redo: the same pieces again, under the quorum that cut them.
        if self.redoing and self.last is not None:
            self.redoing = False
            return self.last
        began = time.perf_counter()
        if self.committed or step != self.step or not self.attempts:
            self.step, self.attempts = step, 0
        self.attempts += 1
        self.committed = False
        before = manager.current_step()
        while True:
            try:
                manager.start_quorum()
                groups = manager.num_participants()
            except Exception as err:  # noqa: BLE001 - a timeout or an unreachable Lighthouse, in one line
                raise FtError(self._quorum_error(err)) from None
            # Every group at the first step, and at the step a rerun resumed from (the quorum's step: a healing
            # group's is the live groups'); a group restarted mid-run joins the ones alive (alone, when none is:
            # the others finished or died, and ft.min_groups allows it).
            at = manager.current_step()
            rerun = not self.started and at == self.resumed_at and not self.restarted
            if groups >= (cfg.groups if at == 0 or rerun else cfg.min_groups):
                break
            if time.perf_counter() - began > cfg.quorum_timeout_s:
                raise FtError(
                    f"ft: only {groups} of ft.groups={cfg.groups} replica group(s) joined within ft.quorum_timeout_s="
                    f"{cfg.quorum_timeout_s:g} s (the first step waits for all; later ones for ft.min_groups="
                    f"{cfg.min_groups})"
                )
            time.sleep(cfg.quorum_tick_ms / 1000)
        self.started = True
        index = manager.participating_rank()
        assert index is not None, "a synchronous quorum admits every group it names"
        healed = manager.current_step() != before
        groups, place = self._takers(healed, groups, int(index))
        self.last = Quorum(groups, place, time.perf_counter() - began, healed)
        return self.last

    def _takers(self, healed: bool, groups: int, index: int) -> tuple[int, int]:
        """(the groups that take pieces of this step, this group's place among them; -1: none). A group that healed
        in this quorum sits the step out, so that nothing it computes is thrown away, unless that would leave fewer
        than ``ft.min_groups`` to cut the window for. Who healed is known only to itself: one small sum across the
        groups present says it (a failure there fails the step, which is computed again under the next quorum)."""
        from torch.distributed import ReduceOp

        flags = torch.zeros(self.cfg.groups, dtype=torch.float64)
        flags[self.group] = 0.0 if healed else 1.0
        self.manager.allreduce(flags, reduce_op=ReduceOp.SUM).wait()
        self.sent_bytes += flags.numel() * flags.element_size()
        takers = [i for i in range(self.cfg.groups) if flags[i] > 0.5]
        if self.manager.errored() is not None or len(takers) < self.cfg.min_groups:
            return groups, index  # every group present takes pieces (or the step fails to commit)
        return len(takers), takers.index(self.group) if self.group in takers else -1

    def _quorum_error(self, err: Exception) -> str:
        cfg = self.cfg
        return (
            f"ft: no quorum of ft.min_groups={cfg.min_groups} replica group(s) within ft.quorum_timeout_s="
            f"{cfg.quorum_timeout_s:g} s from the Lighthouse at {self.lighthouse()} (fewer groups than the minimum, "
            f"or the Lighthouse unreachable): {first_line(err)}"
        )

    def join(self, state: Callable[[], Any], load: Callable[[Any], None]) -> None:
        """An engine sums the gradients across groups and votes itself; ``state()`` travels to a healing group."""
        self.carried.append((state, load))

    @property
    def engine_sums(self) -> bool:
        """Whether an engine joined (:meth:`join`): the window's totals then sum only their row and do not vote."""
        return bool(self.carried)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> None:
        """Reduce ``tensor`` over the groups present, in place: ``"sum"`` (never torchft's average) or ``"max"``. A
        failure is recorded by the Manager, and the step is then not committed (:meth:`vote`)."""
        from torch.distributed import ReduceOp

        reduce_op = {"sum": ReduceOp.SUM, "max": ReduceOp.MAX}[op]
        self.manager.allreduce(tensor, reduce_op=reduce_op).wait()
        self.sent_bytes += tensor.numel() * tensor.element_size()

    def vote(self) -> bool:
        """Every group present votes; False: the step is computed again under the next quorum (FtError after
        ``ft.max_retries`` in a row)."""
        try:
            self.committed = bool(self.manager.should_commit())
        except RuntimeError as err:
            raise FtError(
                f"ft: step {self.step + 1} failed to commit {self.attempts} times in a row (ft.max_retries="
                f"{self.cfg.max_retries}): {first_line(err)}"
            ) from None
        return self.committed

    def shutdown(self) -> None:
        """Stop this group's Manager (its server and checkpoint transport)."""
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None


def first_line(err: BaseException) -> str:
    """An exception's first line, with its type."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"
