"""Which ranks form each island of an outer-synced run, and the two groups that follow from it.

Island i holds the ``size`` consecutive ranks i*size .. (i+1)*size-1: a multi-node launch numbers ranks node by
node, so with one island per node every island's inner group stays inside its node and only the outer sync
crosses the slow link. The device mesh is ``(islands, size)`` named ``("island", "inner")``: the ``inner``
dimension is the island (the engine's whole world: DDP's process group, FSDP2's mesh, the window's collective),
the ``island`` dimension joins the ranks of equal inner index across islands (the outer sync's group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from distaccum.runtime.topology import group_lines, replica_groups


@dataclass(frozen=True)
class IslandLayout:
    """The pure layout: ``islands`` islands of ``size`` ranks each; this rank's place in it."""

    islands: int
    size: int
    rank: int

    @classmethod
    def of(cls, world: int, rank: int, islands: int) -> IslandLayout:
        """The layout of ``world`` ranks in ``islands`` islands; ValueError when it does not divide."""
        if islands < 1 or world % islands:
            raise ValueError(
                f"outer.islands={islands} must divide the world of {world} ranks (each island holds "
                f"world/islands ranks)"
            )
        return cls(islands, world // islands, rank)

    @property
    def index(self) -> int:
        """This rank's island."""
        return self.rank // self.size

    @property
    def inner_rank(self) -> int:
        """This rank's rank inside its island."""
        return self.rank % self.size

    def groups(self) -> list[list[int]]:
        """Every island's global ranks, island by island (the same rows as HSDP's replicas)."""
        return replica_groups(self.islands * self.size, self.islands)

    def ranks(self, island: int) -> list[int]:
        """The global ranks of ``island``."""
        return self.groups()[island]

    def peers(self, inner_rank: int) -> list[int]:
        """The global ranks of inner index ``inner_rank`` in every island (one outer-sync group)."""
        return [i * self.size + inner_rank for i in range(self.islands)]


def resolve_islands(value: int | str, world: int, nodes: int) -> int:
    """``outer.islands`` as a number: auto is one island per node on a multi-node launch, else one per rank."""
    if value == "auto":
        return nodes if nodes > 1 else world
    return int(value)


def island_lines(islands: int, nodes: int, per_node: int) -> list[str]:
    """What an outer-synced launch of ``nodes`` x ``per_node`` ranks in ``islands`` islands will look like, for the
    launchers to show (they number each node's ranks consecutively, so island i holds ranks i*S .. i*S+S-1)."""
    world = nodes * per_node
    if islands < 1 or world % islands:
        return []
    return group_lines(
        islands,
        nodes,
        per_node,
        f"outer sync: {islands} islands x {world // islands} rank(s) over {nodes} node(s) of {per_node} ranks "
        "(every optimizer step reduces inside an island; only the outer sync crosses between islands):",
        "warning: an island spans nodes, so its reduction of every optimizer step crosses the slow link; "
        "choose outer.islands as a multiple of the node count",
        name="island",
    )


@dataclass
class Islands:
    """The layout with its process groups (built collectively by every rank, once, before the engine)."""

    layout: IslandLayout
    mesh: Any
    """The ``(islands, size)`` DeviceMesh named ``("island", "inner")``."""

    @classmethod
    def build(cls, layout: IslandLayout, device: torch.device) -> Islands:
        """Create the mesh and its groups (collective: every rank calls it)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type, (layout.islands, layout.size), mesh_dim_names=("island", "inner")
        )
        return cls(layout, mesh)

    @property
    def inner_mesh(self) -> Any:
        """The island's 1-D mesh (FSDP2 shards over it)."""
        return self.mesh["inner"]

    @property
    def inner_group(self) -> Any:
        """The island's process group: every collective of an optimizer step runs on it."""
        return self.mesh.get_group("inner")

    def host_group(self) -> Any:
        """The island's group for host (CPU) tensors: the inner group on CPU; on CUDA a gloo group of the island's
        ranks (collective: every rank creates every island's)."""
        if self.mesh.device_type != "cuda":
            return self.inner_group
        import torch.distributed as dist

        mine, _ = dist.new_subgroups_by_enumeration(self.layout.groups(), backend="gloo")
        return mine

    @property
    def outer_group(self) -> Any:
        """The group of this rank's peers in the other islands (the outer sync)."""
        return self.mesh.get_group("island")
