"""The α–β cost model of collectives: pure functions, no torch.

A message of ``n`` bytes over a link costs ``α + n/β`` seconds (Hockney's model): α is the latency of
one message (software and wire), β the bandwidth of the stream in bytes per second. A reduction adds
``γ`` seconds per reduced byte (the local arithmetic; NCCL fuses it into the copy, so on GPUs γ ≈ 0).
The formulas are those of Thakur, Rabenseifner & Gropp (2005), "Optimization of Collective
Communication Operations in MPICH", with β written as a bandwidth; the ring all-reduce reaches the
bandwidth lower bound 2(p-1)/p · n/β of Patarasuk & Yuan (2009), "Bandwidth optimal all-reduce
algorithms for clusters of workstations". For p ranks, ``n`` is always the full buffer of one rank
(all-reduce: in = out = n; reduce-scatter: n in, n/p out; all-gather: n/p in, n out):

    ring all-reduce          2(p-1) α + 2 (p-1)/p · n/β + (p-1)/p · n γ
    ring reduce-scatter       (p-1) α +   (p-1)/p · n/β + (p-1)/p · n γ
    ring all-gather           (p-1) α +   (p-1)/p · n/β
    halving-doubling         ring's bandwidth terms with ⌈log2 p⌉ α (reduce-scatter, all-gather) or
                             2⌈log2 p⌉ α (all-reduce, Rabenseifner's algorithm); p a power of two
    binomial tree all-reduce 2⌈log2 p⌉ (α + n/β) + ⌈log2 p⌉ n γ (a reduce, then a broadcast)

Two levels (nodes of GPUs): a :class:`Group` spans ``nodes`` nodes with ``per_node`` of its ranks on
each, and ``concurrent`` groups like it use each node's network link at the same time (the node's
inter-node bandwidth is shared by all its streams). Two algorithms are modelled across nodes: a flat
ring through every rank (each step as slow as its slowest edge, the shared inter-node one) and the
hierarchical one (reduce-scatter inside the node, the collective across nodes on 1/per_node of the
data by per_node streams at once, all-gather inside the node). :func:`collective` takes the fastest
modelled algorithm, as a tuned library would; which algorithm NCCL really picks, congestion in the
network and in-network reduction (SHARP) are not modelled.

On one machine whose processes talk over loopback (gloo on CPU), the "link" is the CPUs copying
through the kernel: p processes on c < p cores take p/c times as long (:func:`cpu_shared`). That is
how a world of 4 on a 2-core machine is predicted from α, β and γ fitted at world 2 (:func:`fit_link`;
``tests/test_collectives.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

OPS = ("all_reduce", "reduce_scatter", "all_gather")
"""The collectives the model prices."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """One stream between two neighbouring ranks."""

    alpha_s: float
    """Latency of one message (one step of an algorithm), seconds."""
    beta_bytes_per_s: float
    """Bandwidth of the stream, bytes per second (each direction)."""
    gamma_s_per_byte: float = 0.0
    """Seconds per byte of local reduction arithmetic (0: fused into the copy, as NCCL does)."""

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.beta_bytes_per_s > 0 and self.gamma_s_per_byte >= 0):
            raise ValueError(
                f"a link needs alpha_s >= 0, beta_bytes_per_s > 0 and gamma_s_per_byte >= 0, got "
                f"alpha_s={self.alpha_s}, beta_bytes_per_s={self.beta_bytes_per_s}, "
                f"gamma_s_per_byte={self.gamma_s_per_byte}"
            )

    def shared(self, streams: int) -> Link:
        """This link carrying ``streams`` streams at once: each gets 1/streams of the bandwidth."""
        return replace(self, beta_bytes_per_s=self.beta_bytes_per_s / max(streams, 1))


def gbps(gbit_per_s: float) -> float:
    """Gbit/s (the unit of network and NVLink data sheets) to bytes per second."""
    return gbit_per_s * 1e9 / 8


def _check(op: str, n_bytes: float, p: int) -> None:
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; one of {', '.join(OPS)}")
    if p < 1 or n_bytes < 0:
        raise ValueError(f"a collective needs p >= 1 ranks and n >= 0 bytes, got p={p}, n={n_bytes}")


def ring_terms(op: str, n_bytes: float, p: int) -> tuple[float, float, float]:
    """``(a, b, c)`` with ring time = a·α + b/β + c·γ: the message count, the bytes one rank sends
    and the bytes it reduces."""
    _check(op, n_bytes, p)
    share = (p - 1) / p * n_bytes
    if op == "all_reduce":
        return 2 * (p - 1), 2 * share, share
    return p - 1, share, share if op == "reduce_scatter" else 0.0


def ring(op: str, n_bytes: float, p: int, link: Link) -> float:
    """Seconds of a ring ``op`` of ``n_bytes`` per rank over ``p`` ranks."""
    a, b, c = ring_terms(op, n_bytes, p)
    return a * link.alpha_s + b / link.beta_bytes_per_s + c * link.gamma_s_per_byte


def halving_doubling(op: str, n_bytes: float, p: int, link: Link) -> float | None:
    """Recursive halving (reduce-scatter), recursive doubling (all-gather), both (all-reduce,
    Rabenseifner): the ring's bandwidth terms with log2 p messages per phase. None unless p is a
    power of two (other p need extra steps, not modelled)."""
    _check(op, n_bytes, p)
    if p & (p - 1):
        return None
    steps = int(math.log2(p))
    a, b, c = ring_terms(op, n_bytes, p)
    phases = 2 if op == "all_reduce" else 1
    return phases * steps * link.alpha_s + b / link.beta_bytes_per_s + c * link.gamma_s_per_byte


def binomial_all_reduce(n_bytes: float, p: int, link: Link) -> float:
    """A binomial-tree reduce then broadcast: the latency-optimal all-reduce for short messages."""
    _check("all_reduce", n_bytes, p)
    steps = math.ceil(math.log2(p)) if p > 1 else 0
    return (
        2 * steps * (link.alpha_s + n_bytes / link.beta_bytes_per_s) + steps * n_bytes * link.gamma_s_per_byte
    )


def one_level(op: str, n_bytes: float, p: int, link: Link) -> list[tuple[str, float]]:
    """Every modelled algorithm for ``op`` on one kind of link: ``(name, seconds)``."""
    found = [("ring", ring(op, n_bytes, p, link))]
    hd = halving_doubling(op, n_bytes, p, link)
    if hd is not None and p > 2:  # for p = 2 it is the ring
        found.append(("halving-doubling", hd))
    if op == "all_reduce" and p > 2:
        found.append(("binomial tree", binomial_all_reduce(n_bytes, p, link)))
    return found


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Nodes of GPUs: a fast link inside a node, a slower one between nodes."""

    nodes: int
    gpus_per_node: int
    intra: Link
    """One GPU's link to the others in its node (NVLink): not shared between GPUs."""
    inter: Link
    """One node's network link (all its NICs together): shared by every stream leaving the node."""

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(
                f"a topology needs nodes >= 1 and gpus_per_node >= 1, got nodes={self.nodes}, "
                f"gpus_per_node={self.gpus_per_node}"
            )

    @property
    def world(self) -> int:
        """Ranks in all: one per GPU."""
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True)
class Group:
    """A process group laid out on a :class:`Topology`."""

    nodes: int
    """Nodes it spans."""
    per_node: int
    """Its ranks on each of those nodes."""
    concurrent: int = 1
    """Groups like it on each node running the same collective at the same time."""

    @property
    def size(self) -> int:
        """Ranks in the group."""
        return self.nodes * self.per_node


def world_group(topo: Topology) -> Group:
    """Every rank: the group of DDP, flat FSDP and DeepSpeed."""
    return Group(nodes=topo.nodes, per_node=topo.gpus_per_node)


def hsdp_groups(topo: Topology, replicas: int) -> tuple[Group, Group]:
    """``(shard, replicate)`` groups of HSDP with ``replicas`` replicas of world/replicas ranks each, ranks
    numbered node by node: shard groups are consecutive ranks, a replicate group takes one rank of each."""
    world, g = topo.world, topo.gpus_per_node
    if replicas < 1 or world % replicas:
        raise ValueError(f"replicas={replicas} must divide the world of {topo.nodes} x {g} = {world} ranks")
    shard = world // replicas
    if shard <= g and g % shard == 0:  # shard groups inside a node, replicas across every node
        return (
            Group(nodes=1, per_node=shard, concurrent=g // shard),
            Group(nodes=topo.nodes, per_node=g // shard, concurrent=shard),
        )
    if shard % g == 0:  # shard groups of whole nodes, one rank per node in a replicate group
        return Group(nodes=shard // g, per_node=g), Group(nodes=replicas, per_node=1, concurrent=g)
    raise ValueError(
        f"replicas={replicas} gives shard groups of {shard} ranks, which straddle nodes of {g} GPUs "
        f"unevenly: the shard group size must divide {g} or be a multiple of it"
    )


@dataclass(frozen=True)
class Estimate:
    """The modelled time of one collective and the algorithm it assumes."""

    seconds: float
    algorithm: str


def collective(op: str, n_bytes: float, group: Group, topo: Topology) -> Estimate:
    """The fastest modelled algorithm for ``op`` of ``n_bytes`` per rank on ``group``."""
    _check(op, n_bytes, group.size)
    if group.size == 1 or n_bytes == 0:
        return Estimate(0.0, "none")
    if group.nodes == 1:
        found = one_level(op, n_bytes, group.per_node, topo.intra)
        return Estimate(*min(found, key=lambda f: f[1])[::-1])
    q, m = group.per_node, group.nodes
    # Flat ring: every step moves n/p over each edge at once; the node's network edge is the slowest.
    net = topo.inter.shared(group.concurrent)
    steps, per_step_bytes, reduced = ring_terms(op, n_bytes, group.size)
    step_bytes, step_reduced = per_step_bytes / steps, reduced / steps
    links = [net] + ([topo.intra] if q > 1 else [])
    step = max(
        link.alpha_s + step_bytes / link.beta_bytes_per_s + step_reduced * link.gamma_s_per_byte
        for link in links
    )
    found = [("flat ring", steps * step)]
    if q > 1:  # hierarchical: inside the node on n, across nodes on n/q by q streams per group at once
        across = min(
            one_level(op, n_bytes / q, m, topo.inter.shared(group.concurrent * q)), key=lambda f: f[1]
        )
        inside = {
            "all_reduce": ("reduce_scatter", "all_gather"),
            "reduce_scatter": ("reduce_scatter",),
            "all_gather": ("all_gather",),
        }[op]
        seconds = across[1] + sum(ring(o, n_bytes, q, topo.intra) for o in inside)
        found.append((f"hierarchical (ring in node, {across[0]} across nodes)", seconds))
    else:
        found += [(f"{name} across nodes", s) for name, s in one_level(op, n_bytes, m, net) if name != "ring"]
    return Estimate(*min(found, key=lambda f: f[1])[::-1])


def cpu_shared(seconds: float, processes: int, cores: int) -> float:
    """``seconds`` measured with a core per process, for ``processes`` sharing ``cores`` CPU cores: on
    loopback every term of the model is CPU time (copies through the kernel, reductions, wake-ups)."""
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return seconds * max(1.0, processes / cores)


@dataclass(frozen=True)
class Sample:
    """One measured collective: ``op`` of ``n_bytes`` per rank on ``p`` ranks took ``seconds``."""

    op: str
    p: int
    n_bytes: int
    seconds: float


def predict_ring(op: str, n_bytes: float, p: int, link: Link, cores: int) -> float:
    """What a ring ``op`` should take on a loopback machine with ``cores`` cores (:func:`cpu_shared`)."""
    return cpu_shared(ring(op, n_bytes, p, link), p, cores)


def fit_link(samples: Sequence[Sample], cores: int) -> Link:
    """α, β and γ minimising the squared *relative* error of :func:`predict_ring` over ``samples``
    (linear least squares in α, 1/β and γ; a latency or reduction term that comes out negative is fixed
    at 0 and the rest refitted). Reduce-scatter samples separate γ from β; all-gather samples alone cannot."""
    if not samples:
        raise ValueError("fit_link needs samples")
    rows = [
        [term * max(1.0, s.p / cores) / s.seconds for term in ring_terms(s.op, s.n_bytes, s.p)]
        for s in samples
    ]
    free = [i for i in range(3) if any(row[i] for row in rows)]  # all-gathers alone: no reduction term
    while True:
        values = dict(
            zip(
                free, _least_squares([[row[i] for i in free] for row in rows], [1.0] * len(rows)), strict=True
            )
        )
        negative = [i for i in free if i != 1 and values[i] < 0]
        if not negative:
            break
        free.remove(min(negative, key=lambda i: values[i]))
    if values.get(1, 0.0) <= 0:
        raise ValueError("the samples give no positive bandwidth: their times do not grow with size")
    return Link(
        alpha_s=values.get(0, 0.0), beta_bytes_per_s=1.0 / values[1], gamma_s_per_byte=values.get(2, 0.0)
    )


def _least_squares(a: list[list[float]], y: list[float]) -> list[float]:
    """Solve min |A x - y| through the normal equations of the column-normalised A (a handful of
    unknowns whose scales differ by many orders of magnitude: seconds, seconds per byte)."""
    k = len(a[0])
    norms = [math.sqrt(sum(r[j] ** 2 for r in a)) or 1.0 for j in range(k)]
    a = [[r[j] / norms[j] for j in range(k)] for r in a]
    m = [
        [sum(r[i] * r[j] for r in a) for j in range(k)] + [sum(r[i] * v for r, v in zip(a, y, strict=True))]
        for i in range(k)
    ]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            raise ValueError("the samples cannot separate the model's terms (add sizes or collectives)")
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * yv for x, yv in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] / norms[i] for i in range(k)]
