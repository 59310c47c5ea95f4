"""How the CPU window's totals travel: every rank's row of a few numbers to every rank, once per optimizer step.

The window's one collective (:class:`~distaccum.window.HostTotals`) is an exchange of each rank's row (its item
count, loss sum, flags and the rows checks carry; a few dozen float64 numbers). Two transports give every rank the
same rows in rank order, so the same totals bit for bit:

- :class:`GlooExchange`, the process group's all-gather: any number of hosts. gloo hands every collective to its
  worker thread and back (a queue, a wake-up, the transfer, a completion, a wake-up), which for a hundred bytes
  costs more than the transfer (``benchmarks.fixed_cost``, BENCHMARKS.md).
- :class:`SocketExchange`, a connected Unix stream socket between every two ranks, when all of them are on this
  host: the calling thread writes its row to every peer when the window's collective is launched (before the last
  backward) and reads theirs when the totals are first needed (after the gradient reduction, by which time every
  rank has written). Its sockets live in Linux's abstract namespace (no file to clean up), named by a random token
  rank 0 draws for this process group, so two runs, or two attempts of one run, never meet.

:func:`window_exchange` picks one for a run, collectively: the sockets when every rank reports this host's name and
every rank could bind, connect and accept, otherwise gloo on every rank alike. A peer that stops answering fails the
exchange after ``timeout_s`` (the run's ``trainer.collective_timeout_s``, as gloo's collectives) with a
:class:`TimeoutError` naming it; one that exits fails it at once with a :class:`ConnectionError` naming it.
"""

from __future__ import annotations

import secrets
import socket
import struct
import sys
import threading
from array import array
from typing import Protocol

import torch
import torch.distributed as dist

from distaccum.cluster.procgroup import all_gather_flat

_HEADER = struct.Struct("<I")
"""Each message: the row's length (numbers), then the row as float64."""


def _fill(peer: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``peer`` (a stream may hand a message over in pieces); EOF raises ``EOFError``."""
    got = 0
    while got < len(into):
        n = peer.recv_into(into[got:])
        if n == 0:
            raise EOFError
        got += n


class Pending(Protocol):
    """An exchange under way."""

    def wait(self) -> list[list[float]]:
        """Every rank's row, in rank order (this rank's included), once they have arrived; called again, from any
        thread, the same rows."""
        ...


class RowExchange(Protocol):
    """A transport for the window's rows (every rank's the same length)."""

    name: str

    def exchange(self, row: list[float]) -> Pending:
        """Start sending this rank's ``row`` to every rank; the result's ``wait`` gives every rank's."""
        ...

    def close(self) -> None: ...


class _Gathered:
    def __init__(self, row: list[float]) -> None:
        local = torch.tensor(row, dtype=torch.float64)
        self.world = dist.get_world_size()
        self.rows = torch.empty(self.world * local.numel(), dtype=torch.float64)
        self.work = all_gather_flat(self.rows, local, async_op=True)

    def wait(self) -> list[list[float]]:
        self.work.wait()
        return self.rows.view(self.world, -1).tolist()


class GlooExchange:
    """The rows through the default process group's all-gather (:func:`~distaccum.cluster.procgroup.all_gather_flat`)."""

    name = "gloo"

    def exchange(self, row: list[float]) -> Pending:
        return _Gathered(row)

    def close(self) -> None:
        pass


class _Received:
    """The peers' rows, read on the first :meth:`wait`; a later one, on any thread, returns the same. DDP runs its
    comm hook's continuations on the process group's threads, one per bucket, so two buckets can ask for the
    window's scale at once: two readers of one socket would each take part of a message."""

    def __init__(self, mesh: SocketExchange, mine: list[float]) -> None:
        self.mesh, self.mine = mesh, mine
        self._lock = threading.Lock()
        self._rows: list[list[float]] | None = None

    def wait(self) -> list[list[float]]:
        with self._lock:
            if self._rows is None:
                self._rows = self._read()
            return self._rows

    def _read(self) -> list[list[float]]:
        mesh, rows = self.mesh, [self.mine] * self.mesh.world
        for rank, peer in mesh.peers.items():
            header = bytearray(_HEADER.size)
            mesh.receive(rank, peer, memoryview(header))
            (length,) = _HEADER.unpack(header)
            if length != len(self.mine):
                raise RuntimeError(f"the window's exchange: rank {rank} sent a row of {length} numbers, rank "
                                   f"{mesh.rank} {len(self.mine)}: the ranks disagree on the window's layout")
            data = array("d", bytes(8 * length))
            mesh.receive(rank, peer, memoryview(data).cast("B"))
            rows[rank] = data.tolist()
        return rows


class SocketExchange:
    """A connected Unix stream socket between every two ranks of this host (:func:`window_exchange` builds it)."""

    name = "sockets"

    def __init__(self, rank: int, world: int, peers: dict[int, socket.socket], timeout_s: float) -> None:
        self.rank, self.world, self.peers, self.timeout_s = rank, world, dict(sorted(peers.items())), timeout_s
        self.closed = False
        for peer in self.peers.values():
            peer.settimeout(timeout_s)

    def exchange(self, row: list[float]) -> Pending:
        if self.closed:
            raise RuntimeError("the window's exchange is closed (the Trainer finished)")
        message = _HEADER.pack(len(row)) + array("d", row).tobytes()
        for rank, peer in self.peers.items():
            try:
                peer.sendall(message)
            except TimeoutError as err:
                raise self._timed_out(rank, "to accept") from err
            except OSError as err:
                raise self._closed(rank, err) from err
        return _Received(self, row)

    def receive(self, rank: int, peer: socket.socket, into: memoryview) -> None:
        """Fill ``into`` from rank ``rank``'s socket, its failures named (:func:`_fill`)."""
        try:
            _fill(peer, into)
        except TimeoutError as err:
            raise self._timed_out(rank, "for") from err
        except EOFError:
            raise self._closed(rank, None) from None
        except OSError as err:
            raise self._closed(rank, err) from err

    def _timed_out(self, rank: int, what: str) -> TimeoutError:
        return TimeoutError(f"the window's exchange timed out: rank {self.rank} waited {self.timeout_s:g} s {what} "
                            f"rank {rank}'s row (trainer.collective_timeout_s); rank {rank} is stopped, hung or "
                            "far behind")

    def _closed(self, rank: int, err: OSError | None) -> ConnectionError:
        why = f" ({type(err).__name__}: {err})" if err is not None else ""
        return ConnectionError(f"the window's exchange: rank {rank} closed its socket{why}: it exited or failed")

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.closed = True


def _address(token: str, rank: int) -> str:
    return f"\0distaccum-{token}-{rank}"


def _all(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (collective)."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(flag)
    return int(flag) == 0


def _connect(rank: int, world: int, token: str, timeout_s: float) -> dict[int, socket.socket]:
    """This rank's end of the mesh: it listens, then (once every rank listens) connects to the lower ranks, saying
    who it is, and accepts the higher ones. Raises OSError where a socket cannot be made; collective."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    peers: dict[int, socket.socket] = {}
    try:
        try:
            listener.bind(_address(token, rank))
            listener.listen(world)
            bound = True
        except OSError:
            bound = False
        if not _all(bound):
            raise OSError("a rank could not listen")
        listener.settimeout(timeout_s)
        try:
            for lower in range(rank):  # the kernel queues the connection: no accept needed first
                peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                peers[lower] = peer
                peer.settimeout(timeout_s)
                peer.connect(_address(token, lower))
                peer.sendall(_HEADER.pack(rank))
            for _ in range(rank + 1, world):
                peer, _ = listener.accept()
                peer.settimeout(timeout_s)
                who = bytearray(_HEADER.size)
                _fill(peer, memoryview(who))
                peers[_HEADER.unpack(who)[0]] = peer
            connected = sorted(peers) == [r for r in range(world) if r != rank]
        except (OSError, EOFError):  # EOF: a peer closed its socket while connecting
            connected = False
        if not _all(connected):
            raise OSError("a rank could not connect")
        return peers
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    finally:
        listener.close()


def window_exchange(timeout_s: float) -> RowExchange:
    """The transport for this run's CPU window (collective over the default group; every rank gets the same kind):
    :class:`SocketExchange` on Linux when every rank is on this host and could connect to every other (one rank: no
    peers, nothing to send); :class:`GlooExchange` otherwise."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return SocketExchange(0, 1, {}, timeout_s)
    here = [socket.gethostname(), secrets.token_hex(8), sys.platform.startswith("linux")]
    everyone: list[list[object] | None] = [None] * world
    dist.all_gather_object(everyone, here)
    hosts = {str(info[0]) for info in everyone if info is not None}
    if len(hosts) != 1 or not all(info is not None and info[2] for info in everyone):
        return GlooExchange()
    token = str(everyone[0][1])  # type: ignore[index]
    try:
        peers = _connect(rank, world, token, timeout_s)
    except OSError as err:  # every rank raised: _connect's verdicts are collective
        if rank == 0:  # one host, yet no sockets: slower than it could be, so say so
            print(f"distaccum: warning: the window's totals go through gloo, not this host's Unix sockets ({err}: "
                  "a sandbox or separate network namespaces?); the run is unchanged, only each step's small "
                  "exchange costs gloo's hand-off", file=sys.stderr, flush=True)
        return GlooExchange()
    return SocketExchange(rank, world, peers, timeout_s)
