"""Where this process sits in the job: a pure function of the environment mapping.

Two launch contracts are understood:
- torchrun / torch elastic: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
- srun started one task per device: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
  (or SLURM_STEP_TASKS_PER_NODE), SLURM_JOB_NODELIST; MASTER_ADDR defaults to the first node.
Nothing here writes the environment; the worker entry hands ``init_env()`` to the process group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of one worker process."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    """'torchrun', 'slurm' or 'single' (not distributed)."""
    restart_count: int = 0
    node: int | None = None
    """The node this process runs on as the launcher numbers nodes (torchrun's GROUP_RANK, Slurm's
    SLURM_NODEID); None when the launcher did not say."""

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)

    @property
    def nodes(self) -> int:
        """Nodes of the job: world / ranks per node (1 when they do not divide evenly)."""
        per_node = max(self.local_world_size, 1)
        return self.world_size // per_node if self.world_size % per_node == 0 else 1

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> DistEnv:
        """Read the layout from an environment mapping (``os.environ`` or a test dict)."""
        if "RANK" in env and "WORLD_SIZE" in env:
            world = int(env["WORLD_SIZE"])
            return cls(
                rank=int(env["RANK"]),
                world_size=world,
                local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", world)),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
                source="torchrun",
                restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                node=int(env["GROUP_RANK"]) if "GROUP_RANK" in env else None,
            )
        if is_srun_task(env):
            world = int(env["SLURM_NTASKS"])
            per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or str(world)
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
            return cls(
                rank=int(env["SLURM_PROCID"]),
                world_size=world,
                local_rank=int(env.get("SLURM_LOCALID", 0)),
                local_world_size=_first_count(per_node),
                master_addr=env.get("MASTER_ADDR") or first_host(nodelist),
                master_port=int(env.get("MASTER_PORT", DEFAULT_PORT)),
                source="slurm",
                restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
                node=int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else None,
            )
        return cls(0, 1, 0, 1, "127.0.0.1", DEFAULT_PORT, "single")

    def init_env(self) -> dict[str, str]:
        """Variables torch.distributed's env:// init expects, for this layout."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def is_worker(env: Mapping[str, str]) -> bool:
    """True when a launcher (torchrun or srun) already started this process as one rank."""
    return ("RANK" in env and "WORLD_SIZE" in env) or is_srun_task(env)


def is_srun_task(env: Mapping[str, str]) -> bool:
    """An ``srun`` job step with more than one task (a batch script itself is not a step task)."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


def _first_count(tasks_per_node: str) -> int:
    """'2(x3),1' -> 2: Slurm's compressed tasks-per-node list, first node's count."""
    match = re.match(r"\s*(\d+)", tasks_per_node)
    return int(match.group(1)) if match else 1


def first_host(nodelist: str) -> str:
    """First host of a Slurm nodelist such as 'node[03-05,09],gpu1' -> 'node03'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse Slurm nodelist {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}"


def replica_groups(world_size: int, replicas: int) -> list[list[int]]:
    """The ranks of each replica of a ``(replicas, world_size / replicas)`` HSDP mesh, replica by replica:
    replica i is sharded over ranks ``i*S .. i*S+S-1`` (S = world_size / replicas), the mesh's row i."""
    shards = world_size // replicas
    return [list(range(i * shards, (i + 1) * shards)) for i in range(replicas)]


def split_replicas(groups: list[list[int]], nodes: list[int]) -> list[int]:
    """The replicas (indices into ``groups``) whose shard group spans more than one node (``nodes[rank]``):
    their per-micro-batch reduce-scatter crosses the slow link."""
    return [i for i, ranks in enumerate(groups) if len({nodes[r] for r in ranks}) > 1]


def describe_placement(groups: list[list[int]], nodes: list[int]) -> str:
    """One line per replica: its ranks (its shard group) and the nodes they run on."""

    def span(values: list[int]) -> str:
        lo, hi = min(values), max(values)
        return (
            str(lo)
            if lo == hi
            else (f"{lo}-{hi}" if sorted(values) == list(range(lo, hi + 1)) else ",".join(map(str, values)))
        )

    lines = [
        f"  replica {i}: ranks {span(ranks)} on node {span(sorted({nodes[r] for r in ranks}))}"
        for i, ranks in enumerate(groups)
    ]
    return "\n".join(lines)


def resolve_replicas(replicas: int | str, hybrid: bool, world_size: int, nodes: int) -> int:
    """``engine.replicas`` as a number: ``auto`` is one replica per node for an engine that shards within
    replicas (``hybrid``) on a launch of several nodes whose ranks split evenly over them, else 1."""
    if replicas != "auto":
        return int(replicas)
    return nodes if hybrid and nodes > 1 and world_size % nodes == 0 else 1


def placement_plan(replicas: int, nodes: int, per_node: int) -> list[str]:
    """What an HSDP launch of ``nodes`` x ``per_node`` ranks will look like, for launchers to show: the
    launchers (torch elastic, one torchrun per Slurm node) number each node's ranks consecutively, so mesh
    row i (replica i) holds ranks i*S .. i*S+S-1 and, with replicas = nodes, each replica is one node."""
    world = nodes * per_node
    if replicas <= 1 or world % replicas:
        return []
    return groups_plan(
        replicas,
        nodes,
        per_node,
        f"HSDP: {replicas} replicas x {world // replicas} shards over {nodes} node(s) of {per_node} ranks "
        "(a shard group = one replica; the reduce-scatter stays inside it, the all-reduce crosses replicas):",
        "warning: a shard group spans nodes, so the per-micro-batch reduce-scatter crosses the slow "
        "link; choose engine.replicas as a multiple of the node count",
    )


def groups_plan(
    groups: int, nodes: int, per_node: int, header: str, warning: str, name: str = "replica"
) -> list[str]:
    """``header``, one line per group of consecutive ranks (``groups`` of them over ``nodes`` x ``per_node``) and
    the nodes it runs on, and ``warning`` when a group spans nodes (:func:`placement_plan`, the islands' plan)."""
    world = nodes * per_node
    ranks = replica_groups(world, groups)
    node_of = [rank // per_node for rank in range(world)]
    lines = [header, *describe_placement(ranks, node_of).replace("replica ", f"{name} ").splitlines()]
    return lines + ([warning] if split_replicas(ranks, node_of) else [])
