"""A diagnostic for ``benchmarks.run`` and ``benchmarks.fixed_cost``: the CPU window's exchange of each rank's row over
Unix sockets between the ranks of one host, in place of the gloo all-gather (variant ``distaccum_local_exchange``).

gloo hands every collective to its worker thread and back (a queue, a wake-up, the transfer, a completion, a
wake-up), which costs more than the hundred bytes of a window's row: ``benchmarks.fixed_cost`` puts the all-gather at
about 0.3 ms of CPU per step on this project's 2-core machine. Here each rank writes its row straight to every other
rank's socket from the calling thread when the window's collective is launched (before the last backward), and
reads theirs when the totals are first needed (after the gradient all-reduce, by which time every rank has written):
a send and a receive per peer, no thread in between. What the difference from ``distaccum`` shows is what a cheaper
exchange between the ranks of one host could save; the product keeps gloo (one transport, its timeouts and error
reports, any number of hosts).
"""

from __future__ import annotations

import os
import socket
import struct
from array import array
from typing import Any

import torch
import torch.distributed as dist

from distaccum import window


def _name(key: str, rank: int) -> str:
    """Rank ``rank``'s socket in Linux's abstract namespace (no file to clean up)."""
    return f"\0distaccum-bench-{key}-{rank}"


class LocalMesh:
    """A connected Unix stream socket between every two ranks of this host (built collectively)."""

    def __init__(self, rank: int, world: int, key: str, timeout_s: float = 300.0) -> None:
        self.rank, self.world = rank, world
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(_name(key, rank))
        listener.listen(world)
        dist.barrier()  # every rank listens before anyone connects
        self.peers: dict[int, socket.socket] = {}
        for lower in range(rank):  # connect to the lower ranks, saying who this is
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.connect(_name(key, lower))
            peer.sendall(struct.pack("<i", rank))
            self.peers[lower] = peer
        for _ in range(rank + 1, world):  # accept the higher ones
            peer, _ = listener.accept()
            who = bytearray(4)
            _receive(peer, memoryview(who))
            self.peers[struct.unpack("<i", who)[0]] = peer
        listener.close()
        for peer in self.peers.values():
            peer.settimeout(timeout_s)
        dist.barrier()

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()


def _receive(peer: socket.socket, into: memoryview) -> None:
    """Fill ``into`` from ``peer`` (a stream may hand a message over in pieces)."""
    got = 0
    while got < len(into):
        n = peer.recv_into(into[got:])
        if n == 0:
            raise ConnectionError("a rank closed its socket in the middle of a window")
        got += n


class Received:
    """The other ranks' rows, read into their slots of ``rows`` on :meth:`wait` (what a gloo work's ``wait`` does)."""

    def __init__(self, mesh: LocalMesh, rows: torch.Tensor, length: int) -> None:
        self.mesh, self.rows, self.length = mesh, rows, length

    def wait(self) -> None:
        view = memoryview(self.rows.numpy()).cast("B")
        size = self.length * 8
        for rank, peer in self.mesh.peers.items():
            _receive(peer, view[rank * size:(rank + 1) * size])


class HostTotalsLocal(window.HostTotals):
    """:class:`~distaccum.window.HostTotals` whose row goes over :data:`MESH` instead of a gloo all-gather (its
    ``_send``): the same rows in the same layout, so the same totals bit for bit."""

    MESH: LocalMesh | None = None
    """Set by the variant while it runs."""

    def _send(self, row: list[float]) -> None:
        assert self.MESH is not None, "the variant sets the mesh while it runs"
        data = array("d", row)
        self._rows = torch.empty(self.split.world_size * len(data), dtype=torch.float64)
        self._rows.numpy()[self.rank * len(data):(self.rank + 1) * len(data)] = data
        for peer in self.MESH.peers.values():
            peer.sendall(memoryview(data).cast("B"))
        self._work: Any = Received(self.MESH, self._rows, len(data))


def mesh_key() -> str:
    """What tells this launch's sockets from another's on the same host: its rendezvous port (bound while it runs)."""
    return os.environ.get("MASTER_PORT", "0")
