"""The launchers' config sections: ``slurm``, ``kubeflow`` and ``ray`` (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports them) to keep that module under 500 lines; like
:mod:`distaccum.split` it imports nothing of distaccum. ``trainer.*`` still says how many workers start per node
and how often a failed group restarts; these sections say what each cluster is asked for.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
"""An RFC 1123 label: what Kubernetes namespaces must be."""
RFC1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
"""An RFC 1035 label (starts with a letter): what a TrainJob's name must be (its CRD checks it)."""
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""An RFC 1123 subdomain (at most 253 characters): most Kubernetes object names (claims, runtimes)."""
QUANTITY = re.compile(r"^(?P<number>[0-9]+(\.[0-9]*)?|\.[0-9]+)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
"""A positive Kubernetes resource quantity in the usual notation ('2', '500m', '8Gi')."""


def _quantity(name: str, value: object) -> str:
    """``kubeflow.<name>`` as a Kubernetes quantity string (a number from YAML becomes its text)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    match = QUANTITY.match(str(value)) if number or isinstance(value, str) else None
    if match is None or float(match.group("number")) <= 0:
        raise ValueError(
            f"kubeflow.{name}={value!r} must be a positive Kubernetes quantity, e.g. '2', '500m' or '8Gi'"
        )
    return match.string


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
    cpus_per_task: int | None = None
    """CPUs for each node's torchrun task, which runs all of the node's workers; null: slurm.cpus_per_gpu x
    slurm.gpus_per_node on GPU nodes, one per worker (trainer.nproc) on CPU nodes."""
    cpus_per_gpu: int = 8
    """CPUs per GPU worker when slurm.cpus_per_task is null (its data loading and host work)."""
    python: str | None = None
    """The interpreter on the nodes; null: the submitting one (its absolute path), which every node must then reach
    at the same path (a shared filesystem), as the rendered script's header says."""
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
        if self.cpus_per_task is not None:
            _at_least("slurm", "cpus_per_task", self.cpus_per_task, 1)
        _at_least("slurm", "cpus_per_gpu", self.cpus_per_gpu, 1)
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
    """TrainJob name (an RFC 1035 label: lower case, digits, '-', starting with a letter, at most 63 characters)."""
    namespace: str | None = None
    """Namespace of the TrainJob; null: kubectl's current one."""
    runtime: str = "torch-distributed"
    """The ClusterTrainingRuntime the job refers to (the torch runtime, which gives each node's launcher PET_*)."""
    image: str = "distaccum:cpu"
    """Container image holding distaccum (docker/Dockerfile.cpu or .cuda, pushed where the cluster pulls)."""
    nodes: int = 1
    """Nodes (pods), one launcher each."""
    gpus_per_node: int = 0
    """nvidia.com/gpu per node; 0 means CPU workers (trainer.nproc per node)."""
    cpus_per_node: str | None = None
    """CPU request and limit per node (Kubernetes quantity); null: kubeflow.cpus_per_gpu x kubeflow.gpus_per_node on
    GPU nodes, one per worker (trainer.nproc) on CPU nodes."""
    memory_per_node: str | None = None
    """Memory request and limit per node (Kubernetes quantity); null: kubeflow.memory_per_gpu x kubeflow.gpus_per_node
    on GPU nodes, 8Gi on CPU nodes."""
    cpus_per_gpu: int = 8
    """CPUs per GPU worker when kubeflow.cpus_per_node is null."""
    memory_per_gpu: str = "64Gi"
    """Memory per GPU worker when kubeflow.memory_per_node is null (Kubernetes quantity)."""
    volume_claim: str | None = None
    """PersistentVolumeClaim mounted at mount_path for run_dir (checkpoints must outlive a pod); null: none (the
    rendered job then keeps run_dir on the pod's own disk, which a restart loses, and says so)."""
    mount_path: str = "/runs"
    """Where run_dir's volume is mounted (volume_claim, else a scratch emptyDir on the pod's disk); a relative run_dir
    is placed under it, an absolute one must lie under it."""
    env: list[str] = field(default_factory=list)
    """Extra environment variables of every node as NAME=VALUE, e.g. ['WANDB_MODE=offline'] (not PET_*: the
    runtime sets those)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not RFC1035_LABEL.match(self.name):
            raise ValueError(
                f"kubeflow.name={self.name!r} must be a TrainJob name: lower-case letters, digits and '-', "
                "starting with a letter and ending with a letter or digit, at most 63 characters"
            )
        if self.namespace is not None and not DNS_LABEL.match(str(self.namespace)):
            raise ValueError(
                f"kubeflow.namespace={self.namespace!r} must be a Kubernetes name: lower-case letters, digits and "
                "'-', starting and ending with a letter or digit, at most 63 characters"
            )
        for name in ("runtime", "volume_claim"):
            value = getattr(self, name)
            if value is not None and not (DNS_SUBDOMAIN.match(str(value)) and len(str(value)) <= 253):
                raise ValueError(
                    f"kubeflow.{name}={value!r} must be a Kubernetes object name: lower-case letters, digits, "
                    "'-' and '.', at most 253 characters"
                )
        if not self.image or any(c.isspace() for c in self.image):
            raise ValueError(
                f"kubeflow.image={self.image!r} must be a non-empty image reference without whitespace"
            )
        _at_least("kubeflow", "nodes", self.nodes, 1)
        _at_least("kubeflow", "gpus_per_node", self.gpus_per_node, 0)
        # Hydra reads `kubeflow.cpus_per_node=32` as an int: a quantity is a string in the TrainJob.
        if self.cpus_per_node is not None:
            self.cpus_per_node = _quantity("cpus_per_node", self.cpus_per_node)
        if self.memory_per_node is not None:
            self.memory_per_node = _quantity("memory_per_node", self.memory_per_node)
        self.memory_per_gpu = _quantity("memory_per_gpu", self.memory_per_gpu)
        _at_least("kubeflow", "cpus_per_gpu", self.cpus_per_gpu, 1)
        if not self.mount_path.startswith("/") or posixpath.normpath(self.mount_path) == "/":
            raise ValueError(
                f"kubeflow.mount_path must be an absolute directory other than '/', got {self.mount_path!r}"
            )
        self.mount_path = posixpath.normpath(self.mount_path)
        self.env = [str(item) for item in self.env]
        seen: set[str] = set()
        for item in self.env:
            name, eq, _ = item.partition("=")
            if not eq or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", name):
                raise ValueError(f"kubeflow.env entry {item!r} must be NAME=VALUE, e.g. 'WANDB_MODE=offline'")
            if name.startswith("PET_"):
                raise ValueError(
                    f"kubeflow.env entry {item!r}: the torch runtime sets PET_* for each node itself"
                )
            if name in seen:
                raise ValueError(f"kubeflow.env sets {name} twice: {self.env}")
            seen.add(name)


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
    """Where Ray Train keeps its own run state (an absolute path every node reaches); null: run_dir/ray."""
    report_every: int = 50
    """Report the record of every N-th optimizer step and of the last to Ray (ray.train.report; every step's record
    is in run_dir/metrics.jsonl). Every worker takes part in each report, and a report waits until Ray's controller
    took the previous one (it polls every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default): N steps should take
    longer."""

    def __post_init__(self) -> None:
        _at_least("ray", "cpus_per_worker", self.cpus_per_worker, 0)
        _at_least("ray", "gpus_per_worker", self.gpus_per_worker, 0)
        _at_least("ray", "report_every", self.report_every, 1)
