"""Where ranks sit: HSDP replicas (and outer-sync islands) as groups of consecutive ranks on nodes (pure).

The launch contracts themselves (torchrun, srun, Kubeflow, an initialized group) are read in
:mod:`distaccum.runtime.contracts`.
"""

from __future__ import annotations


def replica_groups(world_size: int, replicas: int) -> list[list[int]]:
    """The ranks of each replica of a ``(replicas, world_size / replicas)`` HSDP mesh, replica by replica:
    replica i is sharded over ranks ``i*S .. i*S+S-1`` (S = world_size / replicas), the mesh's row i."""
    shards = world_size // replicas
    return [list(range(i * shards, (i + 1) * shards)) for i in range(replicas)]


def split_replicas(groups: list[list[int]], nodes: list[int]) -> list[int]:
    """The replicas (indices into ``groups``) whose shard group spans more than one node (``nodes[rank]``):
    their per-micro-batch reduce-scatter crosses the slow link."""
    return [i for i, ranks in enumerate(groups) if len({nodes[r] for r in ranks}) > 1]


def describe_placement(groups: list[list[int]], nodes: list[int], noun: str = "replica") -> str:
    """One line per replica (an HSDP replica's shard group, or ``noun``: an outer-synced run's island): its ranks
    and the nodes they run on."""

    def span(values: list[int]) -> str:
        lo, hi = min(values), max(values)
        return (
            str(lo)
            if lo == hi
            else (f"{lo}-{hi}" if sorted(values) == list(range(lo, hi + 1)) else ",".join(map(str, values)))
        )

    lines = [
        f"  {noun} {i}: ranks {span(ranks)} on node {span(sorted({nodes[r] for r in ranks}))}"
        for i, ranks in enumerate(groups)
    ]
    return "\n".join(lines)


def resolve_replicas(replicas: int | str, hybrid: bool, world_size: int, nodes: int) -> int:
    """``engine.replicas`` as a number: ``auto`` is one replica per node for an engine that shards within
    replicas (``hybrid``) on a launch of several nodes whose ranks split evenly over them, else 1."""
    if replicas != "auto":
        return int(replicas)
    return nodes if hybrid and nodes > 1 and world_size % nodes == 0 else 1


def placement_lines(replicas: int, nodes: int, per_node: int) -> list[str]:
    """What an HSDP launch of ``nodes`` x ``per_node`` ranks will look like, for launchers to show: the
    launchers (torch elastic, one torchrun per Slurm node) number each node's ranks consecutively, so mesh
    row i (replica i) holds ranks i*S .. i*S+S-1 and, with replicas = nodes, each replica is one node."""
    world = nodes * per_node
    if replicas <= 1 or world % replicas:
        return []
    return group_lines(
        replicas,
        nodes,
        per_node,
        f"HSDP: {replicas} replicas x {world // replicas} shards over {nodes} node(s) of {per_node} ranks "
        "(a shard group = one replica; the reduce-scatter stays inside it, the all-reduce crosses replicas):",
        "warning: a shard group spans nodes, so the per-micro-batch reduce-scatter crosses the slow "
        "link; choose engine.replicas as a multiple of the node count",
    )


def group_lines(
    groups: int, nodes: int, per_node: int, header: str, warning: str, name: str = "replica"
) -> list[str]:
    """``header``, one line per group of consecutive ranks (``groups`` of them over ``nodes`` x ``per_node``) and
    the nodes it runs on, and ``warning`` when a group spans nodes (:func:`placement_lines`, the islands' lines)."""
    world = nodes * per_node
    ranks = replica_groups(world, groups)
    node_of = [rank // per_node for rank in range(world)]
    lines = [header, *describe_placement(ranks, node_of).replace("replica ", f"{name} ").splitlines()]
    return lines + ([warning] if split_replicas(ranks, node_of) else [])
