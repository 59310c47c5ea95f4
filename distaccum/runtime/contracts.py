"""How this process was started: the launch contracts distaccum recognises, as pure functions of the environment.

One place reads them all (the CLI entry, the worker and the process group call :func:`recognize`):

- **torchrun / torch elastic** (also what distaccum's own launcher gives its workers): RANK, WORLD_SIZE,
  LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; TORCHELASTIC_RESTART_COUNT > 0 on an elastic restart
  (the world may have changed size: the run resumes from its checkpoint at the new world).
- **srun** one task per device: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (or
  SLURM_STEP_TASKS_PER_NODE), SLURM_JOB_NODELIST; MASTER_ADDR defaults to the first node, MASTER_PORT to a port
  derived from the job and step ids (:func:`srun_port`).
- **Kubeflow Trainer's torch runtime** (a TrainJob pod): PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
  PET_MASTER_ADDR, PET_MASTER_PORT, meant for torchrun: ``distaccum train`` in that pod is the node's launcher
  (:class:`NodeLaunch`) and starts PET_NPROC_PER_NODE workers joining the others at the master.
- **An initialized process group** (Ray Train's TorchTrainer, which also sets RANK/WORLD_SIZE/LOCAL_RANK, or a
  user's own script): used as it is, never re-initialized or destroyed by distaccum.
- nothing: a single process.

A contract set only in part (RANK without WORLD_SIZE, PET_NNODES without PET_MASTER_ADDR, ...) is an error that
names what is missing, instead of a silent single-process run. Nothing here writes the environment.
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
                master_port=int(env.get("MASTER_PORT") or srun_port(env)),
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


def is_srun_task(env: Mapping[str, str]) -> bool:
    """An ``srun`` job step with more than one task (a batch script itself is not a step task)."""
    return "SLURM_STEP_ID" in env and "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1


SRUN_PORTS = (10000, 20000)
"""Where :func:`srun_port` draws: below the kernel's ephemeral range (32768-60999 on Linux), so no connection or
listener the kernel numbers can hold the port, and below the ports tests and benchmarks draw (20000 and up)."""


def srun_port(env: Mapping[str, str]) -> int:
    """The rendezvous port of an ``srun`` job step without MASTER_PORT: derived from SLURM_JOB_ID and SLURM_STEP_ID,
    so that the steps of two jobs sharing a node (two users' runs) do not meet on one fixed port, where one step's
    ranks would join the other's store and fail in gloo's connectFullMesh. Every task of the step computes the same
    number. Two steps collide only when their job ids are 2,500 apart (or the same job's steps 4 apart) and they
    share their first node; set MASTER_PORT to choose."""
    low, high = SRUN_PORTS
    job = int(env.get("SLURM_JOB_ID") or 0)
    step = int(env.get("SLURM_STEP_ID") or 0)
    return low + (job * 4 + step % 4) % (high - low)


def parse_nnodes(value: int | str) -> tuple[int, int]:
    """``trainer.nnodes`` (or PET_NNODES) as (MIN, MAX) nodes: ``2`` or ``'2'`` -> (2, 2), ``'1:4'`` -> (1, 4) (an
    elastic launch, torchrun's ``--nnodes=MIN:MAX``). ValueError unless it is N or MIN:MAX with 1 <= MIN <= MAX."""
    text = str(value).strip() if isinstance(value, (int, str)) and not isinstance(value, bool) else ""
    match = re.fullmatch(r"(\d+)(?::(\d+))?", text)
    if not match:
        raise ValueError(
            f"trainer.nnodes must be a number of nodes N or a range MIN:MAX (e.g. 1:4), got {value!r}"
        )
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if low < 1 or high < low:
        raise ValueError(f"trainer.nnodes={value}: need 1 <= MIN <= MAX nodes, got MIN={low}, MAX={high}")
    return low, high


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


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
PET_VARS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
CONTRACTS = ("torchrun", "elastic_restart", "slurm", "kubeflow", "initialized_group", "single")


class ContractError(ValueError):
    """The launch environment is set in part only, or contradicts itself."""


@dataclass(frozen=True)
class NodeLaunch:
    """What a node's launcher was told by its cluster (Kubeflow's torch runtime, PET_*): start ``nproc`` workers
    here, as node ``node_rank`` of ``nnodes`` (an int, or 'MIN:MAX' for an elastic job), meeting at ``master``."""

    nnodes: str
    nproc: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def rdzv_endpoint(self) -> str:
        """host:port of the c10d rendezvous (the master the runtime names)."""
        return f"{self.master_addr}:{self.master_port}"

    def overrides(self) -> dict[str, object]:
        """The ``trainer.*`` values this launch decides (they replace the config's): the cluster, not the config,
        says how many nodes and processes there are. With the c10d rendezvous the node rank is not needed (the
        order of joining decides it), so it is only reported."""
        low, high = parse_nnodes(self.nnodes)
        nnodes: object = low if low == high else self.nnodes
        return {
            "trainer.nnodes": nnodes,
            "trainer.nproc": self.nproc,
            "trainer.rdzv_endpoint": self.rdzv_endpoint,
        }

    def describe(self) -> str:
        """One line for the console."""
        return (
            f"Kubeflow torch runtime (PET_*): node {self.node_rank} of {self.nnodes}, {self.nproc} worker(s) here, "
            f"rendezvous at {self.rdzv_endpoint}"
        )


@dataclass(frozen=True)
class Contract:
    """How this process was started (:func:`recognize`)."""

    kind: str
    """One of :data:`CONTRACTS`."""
    env: DistEnv
    """This process's rank layout (rank 0 of 1 for a node's launcher)."""
    node_launch: NodeLaunch | None = None
    """Set for ``kubeflow``: this process launches its node's workers."""

    @property
    def is_worker(self) -> bool:
        """True when this process is one rank (a launcher already started it, or a group exists)."""
        return self.kind in ("torchrun", "elastic_restart", "slurm", "initialized_group")


def _missing(env: Mapping[str, str], names: tuple[str, ...], required: tuple[str, ...], what: str) -> None:
    present = [n for n in names if n in env]
    missing = [n for n in required if n not in env]
    if present and missing:
        raise ContractError(
            f"{what} environment set in part: {', '.join(present)} set but {', '.join(missing)} missing; "
            f"a launcher sets them all (unset the stray ones to run as one process)"
        )


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ContractError(f"{name}={env[name]!r} is not an integer") from None


def node_launch(env: Mapping[str, str]) -> NodeLaunch | None:
    """The Kubeflow torch runtime's PET_* variables as this node's launch (None when none is set)."""
    _missing(env, PET_VARS, PET_VARS, "Kubeflow torch runtime (PET_*)")
    if "PET_NNODES" not in env:
        return None
    nnodes = env["PET_NNODES"].strip()
    try:
        _, most = parse_nnodes(nnodes)
    except ValueError:
        raise ContractError(f"PET_NNODES={nnodes!r} is neither N nor MIN:MAX") from None
    launch = NodeLaunch(
        nnodes,
        _int(env, "PET_NPROC_PER_NODE"),
        _int(env, "PET_NODE_RANK"),
        env["PET_MASTER_ADDR"],
        _int(env, "PET_MASTER_PORT"),
    )
    if not 0 <= launch.node_rank < most or launch.nproc < 1:
        raise ContractError(
            f"PET_NODE_RANK={launch.node_rank} with PET_NNODES={nnodes} and PET_NPROC_PER_NODE={launch.nproc}: "
            "the node rank must be in [0, nodes) and the processes per node >= 1"
        )
    return launch


def recognize(env: Mapping[str, str], *, group_initialized: bool = False) -> Contract:
    """Which launch contract ``env`` (``os.environ`` or a test's dict) describes; ``group_initialized``: a process
    group exists already in this process (``torch.distributed.is_initialized()``)."""
    if group_initialized:
        # The group exists (Ray Train, a user's script): it decides the ranks, and whatever launch variables are left
        # in the environment (DeepSpeed wants LOCAL_RANK even for one process) are not a contract to check.
        return Contract("initialized_group", DistEnv.from_environ(env))
    _missing(env, TORCHRUN_VARS, ("RANK", "WORLD_SIZE"), "torchrun")
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        _missing(env, ("SLURM_PROCID",), ("SLURM_NTASKS",), "srun task")
    dist_env = DistEnv.from_environ(env)
    if dist_env.source != "single" and not 0 <= dist_env.rank < dist_env.world_size:
        raise ContractError(f"rank {dist_env.rank} is outside a world of {dist_env.world_size}")
    if dist_env.source == "torchrun":
        if dist_env.world_size > 1:
            _missing(env, ("RANK",), ("MASTER_ADDR", "MASTER_PORT"), "torchrun")
        return Contract("elastic_restart" if dist_env.restart_count > 0 else "torchrun", dist_env)
    if dist_env.source == "slurm":
        return Contract("slurm", dist_env)
    launch = node_launch(env)
    if launch is not None:
        return Contract("kubeflow", dist_env, launch)
    return Contract("single", dist_env)
