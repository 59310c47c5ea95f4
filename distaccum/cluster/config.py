"""The launchers' config sections: ``slurm``, ``kubeflow`` and ``ray`` (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports them) to keep that module under 600 lines; like
:mod:`distaccum.split` it imports nothing of distaccum. ``trainer.*`` still says how many workers start per node
and how often a failed group restarts; these sections say what each cluster is asked for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""A Kubernetes object name (RFC 1123 label): what TrainJob names and namespaces must be."""


def _at_least(section: str, name: str, value: float, low: float) -> None:
    if value < low:
        raise ValueError(f"{section}.{name} must be >= {low:g}, got {value!r}")


@dataclass(kw_only=True)
class SlurmConfig:
    """`distaccum submit`: what the rendered sbatch script asks for."""

    nodes: int = 1
    """Nodes (one torchrun per node)."""
    gpus_per_node: int = 0
    """GPUs per node; 0 means CPU workers (trainer.nproc per node)."""
    cpus_per_task: int = 2
    """CPUs for each node's torchrun task."""
    partition: str | None = None
    """--partition, when set."""
    account: str | None = None
    """--account, when set."""
    time: str = "01:00:00"
    """--time limit."""
    job_name: str = "distaccum"
    """--job-name."""
    rdzv_port: int = 29500
    """Port of the c10d rendezvous on the first node."""
    extra: list[str] = field(default_factory=list)
    """Extra #SBATCH directives, e.g. ['--qos=high', '--exclusive']."""
    signal_seconds: int = 120
    """Send USR1 this many seconds before the time limit so a partial window is checkpointed; 0: never."""

    def __post_init__(self) -> None:
        _at_least("slurm", "nodes", self.nodes, 1)
        _at_least("slurm", "cpus_per_task", self.cpus_per_task, 1)
        _at_least("slurm", "gpus_per_node", self.gpus_per_node, 0)
        if not 0 <= self.signal_seconds <= 65535:
            raise ValueError(f"slurm.signal_seconds must be in [0, 65535], got {self.signal_seconds}")
        if not 1 <= self.rdzv_port <= 65535:
            raise ValueError(f"slurm.rdzv_port must be in [1, 65535], got {self.rdzv_port}")
        for name in ("job_name", "time", "partition", "account"):
            value = getattr(self, name)
            if value is not None and (not value or any(c.isspace() for c in value)):
                raise ValueError(f"slurm.{name}={value!r} must be non-empty without whitespace")
        self.extra = list(self.extra)
        for directive in self.extra:
            if not directive.startswith("-") or "\n" in directive:
                raise ValueError(
                    f"slurm.extra entry {directive!r} must be one sbatch option like '--qos=high'"
                )


@dataclass(kw_only=True)
class KubeflowConfig:
    """`distaccum submit --to kubeflow`: the Kubeflow Trainer v2 TrainJob (torch runtime) it renders."""

    name: str = "distaccum"
    """TrainJob name (an RFC 1123 label: lower case, digits, '-')."""
    namespace: str | None = None
    """Namespace of the TrainJob; null: kubectl's current one."""
    runtime: str = "torch-distributed"
    """The ClusterTrainingRuntime the job refers to (the torch runtime, which runs torchrun with PET_* set)."""
    image: str = "distaccum:cpu"
    """Container image holding distaccum (docker/Dockerfile.cpu or .cuda, pushed where the cluster pulls)."""
    nodes: int = 1
    """Nodes (pods), one launcher each."""
    gpus_per_node: int = 0
    """nvidia.com/gpu per node; 0 means CPU workers (trainer.nproc per node)."""
    cpus_per_node: str = "2"
    """CPU request and limit per node (Kubernetes quantity)."""
    memory_per_node: str = "8Gi"
    """Memory request and limit per node (Kubernetes quantity)."""
    volume_claim: str | None = None
    """PersistentVolumeClaim mounted at mount_path for run_dir (checkpoints must outlive a pod); null: none (the
    rendered job then keeps run_dir on the pod's own disk, which a restart loses, and says so)."""
    mount_path: str = "/runs"
    """Where volume_claim is mounted; run_dir is placed under it."""
    env: list[str] = field(default_factory=list)
    """Extra environment variables of every node as NAME=VALUE, e.g. ['WANDB_MODE=offline']."""

    def __post_init__(self) -> None:
        for name in ("name", "namespace"):
            value = getattr(self, name)
            if value is not None and not DNS_LABEL.match(value):
                raise ValueError(
                    f"kubeflow.{name}={value!r} must be a Kubernetes name: lower-case letters, digits and '-', "
                    "starting and ending with a letter or digit, at most 63 characters"
                )
        _at_least("kubeflow", "nodes", self.nodes, 1)
        _at_least("kubeflow", "gpus_per_node", self.gpus_per_node, 0)
        if not self.mount_path.startswith("/"):
            raise ValueError(f"kubeflow.mount_path must be absolute, got {self.mount_path!r}")
        self.env = list(self.env)
        for item in self.env:
            name, eq, _ = str(item).partition("=")
            if not eq or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"kubeflow.env entry {item!r} must be NAME=VALUE, e.g. 'WANDB_MODE=offline'")


@dataclass(kw_only=True)
class RayConfig:
    """`distaccum submit --to ray`: Ray Train's TorchTrainer runs the workers (trainer.nproc x trainer.nnodes of
    them; the worker group restarts up to trainer.max_restarts times and resumes from run_dir's checkpoint)."""

    address: str | None = None
    """The Ray cluster to join ('auto', 'ray://host:10001'); null: RAY_ADDRESS when set, else a local Ray
    started for the run on this machine."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker."""
    gpus_per_worker: float = 0.0
    """GPUs Ray reserves for each worker (> 0 asks Ray for GPU workers)."""
    storage_path: str | None = None
    """Where Ray Train keeps its own run state; null: run_dir/ray."""

    def __post_init__(self) -> None:
        _at_least("ray", "cpus_per_worker", self.cpus_per_worker, 0)
        _at_least("ray", "gpus_per_worker", self.gpus_per_worker, 0)
