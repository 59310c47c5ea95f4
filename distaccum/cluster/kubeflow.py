"""Kubeflow Trainer: render a TrainJob for a run (the torch runtime), apply it with kubectl.

:func:`render_trainjob` is pure (config in, YAML out) and checked against golden files. It builds the TrainJob
with the Kubeflow Trainer API's own models (the ``kubeflow`` extra), so a field that API does not have cannot be
rendered. :func:`submit_trainjob` is the thin executor, the only code here that starts a process.

The torch runtime starts ``kubeflow.nodes`` pods and gives each the PET_* variables it means for torchrun (nodes,
processes per node, node rank, master address and port). The pod's command is ``distaccum train``, which reads
them and becomes its node's launcher (:mod:`distaccum.runtime.contracts`). Each node's ranks are consecutive, as
under Slurm, so the HSDP and island layouts of :mod:`distaccum.cluster.slurm` hold here too.
"""

from __future__ import annotations

import posixpath
import shlex
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml

from distaccum.cluster.base import JobLauncher, LaunchError, Submitted
from distaccum.cluster.config import QUANTITY, KubeflowConfig
from distaccum.cluster.slurm import layout_lines, split_line
from distaccum.config import RunConfig

TRAINJOB_FILE = "trainjob.yaml"
"""File name of the rendered TrainJob inside ``run_dir``."""
API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
RUNTIME_KIND = "ClusterTrainingRuntime"
NODE = "node"
"""The torch runtime's replicated job and its training container are both named ``node``."""
PATCH_MANAGER = "distaccum"
"""Owner of the TrainJob's runtime patch (the volume)."""
VOLUME = "run-dir"
WORKER_ENV = {"PYTHONUNBUFFERED": "1"}
"""Set in every pod before kubeflow.env: the launcher's own lines reach ``kubectl logs`` as they are printed."""
INSTALL_HINT = 'pip install "distaccum[kubeflow]"'


class KubeflowError(LaunchError):
    """The Kubeflow Trainer API models or kubectl are missing, or kubectl failed; the message says what to do."""


@dataclass(frozen=True)
class TrainJobSubmission:
    """What :func:`submit_trainjob` did."""

    manifest: str
    """The rendered TrainJob (YAML)."""
    path: Path | None
    """Where it was written (``run_dir/trainjob.yaml``); None on a dry run."""
    applied: str | None
    """What ``kubectl apply`` answered (``trainjob.trainer.kubeflow.org/NAME created``); None on a dry run."""


def procs_per_node(cfg: RunConfig) -> int:
    """Workers each pod starts: its GPUs, or trainer.nproc CPU workers."""
    return cfg.kubeflow.gpus_per_node if cfg.kubeflow.gpus_per_node > 0 else cfg.trainer.nproc


def kubeflow_world_size(cfg: RunConfig) -> int:
    """Ranks of the rendered TrainJob: nodes x procs per node (for the pre-flight)."""
    return cfg.kubeflow.nodes * procs_per_node(cfg)


def pod_run_dir(cfg: RunConfig) -> str:
    """``run_dir`` as the pods see it: a relative one under ``kubeflow.mount_path``, an absolute one as it is.

    Raises ValueError when it does not lie under ``mount_path`` (outside the volume nothing outlives a pod).
    """
    mount = cfg.kubeflow.mount_path
    path = posixpath.normpath(posixpath.join(mount, cfg.run_dir)) if cfg.run_dir else ""
    if not path or posixpath.commonpath([mount, path]) != mount:
        raise ValueError(
            f"run_dir={cfg.run_dir!r} cannot be used for Kubeflow: it must lie under kubeflow.mount_path={mount!r} "
            "(give a relative run_dir, which is placed under it, or an absolute one below it)"
        )
    return path


def train_command(cfg: RunConfig, overrides: Sequence[str]) -> list[str]:
    """The pods' command: ``distaccum train <overrides> run_dir=<pod_run_dir(cfg)>`` as an argv list.

    No shell runs it, so each override reaches Hydra as it was given. A ``run_dir=`` among ``overrides`` is
    replaced; ``--config-dir`` is refused (a directory on this machine, which the pods do not see).
    """
    for arg in overrides:
        if arg in ("--config-dir", "-cd") or arg.startswith("--config-dir="):
            raise ValueError(
                f"{arg}: the pods do not see this machine's directories; put your config groups in "
                "kubeflow.image instead (or give their values as overrides)"
            )
    kept = [o for o in overrides if o.lstrip("+~").partition("=")[0] != "run_dir"]
    return ["distaccum", "train", *kept, f"run_dir={pod_run_dir(cfg)}"]


def _models() -> ModuleType:
    """The Kubeflow Trainer API's models (the optional ``kubeflow`` extra)."""
    try:
        from kubeflow_trainer_api import models
    except ImportError as err:
        raise KubeflowError(
            f"the Kubeflow Trainer API models are not installed (needed to render a TrainJob): {INSTALL_HINT}"
        ) from err
    return models


def _env(cfg: RunConfig, m: ModuleType) -> list[Any]:
    values = dict(WORKER_ENV)
    for item in cfg.kubeflow.env:  # kubeflow.env wins over the defaults
        name, _, value = item.partition("=")
        values[name] = value
    return [m.IoK8sApiCoreV1EnvVar(name=name, value=value) for name, value in values.items()]


def node_resources(cfg: RunConfig) -> dict[str, str]:
    """Each pod's CPU and memory (requests = limits): kubeflow.cpus_per_node and memory_per_node, or, when null, the
    per-GPU amounts times the node's GPUs (a GPU node), one CPU per worker and 8Gi (a CPU node)."""
    kf = cfg.kubeflow
    gpus = kf.gpus_per_node
    cpus = kf.cpus_per_node or str(kf.cpus_per_gpu * gpus if gpus else cfg.trainer.nproc)
    memory = kf.memory_per_node or (_times(kf.memory_per_gpu, gpus) if gpus else "8Gi")
    return {"cpu": cpus, "memory": memory}


def _times(quantity: str, n: int) -> str:
    """A Kubernetes quantity times ``n`` ('64Gi' x 8 = '512Gi')."""
    match = QUANTITY.match(quantity)  # the config checked it is one
    assert match is not None, quantity
    return f"{float(match.group('number')) * n:g}{quantity[match.end('number') :]}"


def _resources(cfg: RunConfig, m: ModuleType) -> Any:
    kf = cfg.kubeflow
    amounts = node_resources(cfg)
    if kf.gpus_per_node > 0:
        amounts["nvidia.com/gpu"] = str(kf.gpus_per_node)
    # requests = limits: the pods get exactly what they ask for (Guaranteed QoS), no noisy neighbours.
    quantities = {name: m.IoK8sApimachineryPkgApiResourceQuantity(value) for name, value in amounts.items()}
    return m.IoK8sApiCoreV1ResourceRequirements(limits=quantities, requests=dict(quantities))


def _volume_patch(cfg: RunConfig, m: ModuleType) -> Any:
    """The runtime patch that mounts run_dir's volume on the node container of every pod."""
    kf = cfg.kubeflow
    if kf.volume_claim is not None:
        source = {
            "persistent_volume_claim": m.IoK8sApiCoreV1PersistentVolumeClaimVolumeSource(
                claim_name=kf.volume_claim
            )
        }
    else:
        # Without a claim, a scratch directory on the pod's disk: distaccum's images (docker/) run as a non-root
        # user, who could not create mount_path under '/' itself.
        source = {"empty_dir": m.IoK8sApiCoreV1EmptyDirVolumeSource()}
    pod = m.TrainerV1alpha1PodSpecPatch(
        volumes=[m.IoK8sApiCoreV1Volume(name=VOLUME, **source)],
        containers=[
            m.TrainerV1alpha1ContainerPatch(
                name=NODE, volume_mounts=[m.IoK8sApiCoreV1VolumeMount(name=VOLUME, mount_path=kf.mount_path)]
            )
        ],
    )
    job = m.TrainerV1alpha1JobTemplatePatch(
        spec=m.TrainerV1alpha1JobSpecPatch(template=m.TrainerV1alpha1PodTemplatePatch(spec=pod))
    )
    jobset = m.TrainerV1alpha1JobSetSpecPatch(
        replicated_jobs=[m.TrainerV1alpha1ReplicatedJobPatch(name=NODE, template=job)]
    )
    return m.TrainerV1alpha1RuntimePatch(
        manager=PATCH_MANAGER,
        training_runtime_spec=m.TrainerV1alpha1TrainingRuntimeSpecPatch(
            template=m.TrainerV1alpha1JobSetTemplatePatch(spec=jobset)
        ),
    )


def build_trainjob(cfg: RunConfig, overrides: Sequence[str]) -> Any:
    """The TrainJob as the Kubeflow Trainer API's model (``TrainerV1alpha1TrainJob``); see :func:`render_trainjob`.

    Raises :class:`KubeflowError` when the ``kubeflow`` extra is not installed.
    """
    m = _models()
    kf = cfg.kubeflow
    trainer = m.TrainerV1alpha1Trainer(
        image=kf.image,
        command=train_command(cfg, overrides),
        env=_env(cfg, m),
        num_nodes=kf.nodes,
        num_proc_per_node=procs_per_node(cfg),
        resources_per_node=_resources(cfg, m),
    )
    spec = m.TrainerV1alpha1TrainJobSpec(
        runtime_ref=m.TrainerV1alpha1RuntimeRef(name=kf.runtime, kind=RUNTIME_KIND, api_group=API_GROUP),
        trainer=trainer,
        runtime_patches=[_volume_patch(cfg, m)],
    )
    return m.TrainerV1alpha1TrainJob(
        api_version=API_VERSION,
        kind="TrainJob",
        metadata=m.IoK8sApimachineryPkgApisMetaV1ObjectMeta(name=kf.name, namespace=kf.namespace),
        spec=spec,
    )


def _header(cfg: RunConfig, run_dir: str) -> list[str]:
    kf, per_node = cfg.kubeflow, procs_per_node(cfg)
    lines = []
    if kf.volume_claim is None:
        lines += [
            f"WARNING: no kubeflow.volume_claim: run_dir {run_dir} lives on the pod's own disk (an emptyDir at",
            f"{kf.mount_path}), so a restarted pod loses its checkpoints; set kubeflow.volume_claim to keep them.",
        ]
        if kf.nodes > 1:
            lines.append(
                f"With {kf.nodes} pods each rank's checkpoint shards land on its own pod's disk: no checkpoint is whole."
            )
    lines += [
        "Rendered by distaccum.cluster.kubeflow.render_trainjob; submit with `distaccum submit --to kubeflow` "
        "or `kubectl apply -f`.",
        split_line(cfg, kf.nodes, per_node),
        f"Each pod runs `distaccum train` as its node's launcher: it reads the {kf.runtime} runtime's PET_* "
        f"and starts {per_node} worker(s).",
    ]
    if kf.volume_claim is not None:
        shared = f" (ReadWriteMany: {kf.nodes} pods write to it)" if kf.nodes > 1 else ""
        lines.append(
            f"run_dir {run_dir} on PersistentVolumeClaim {kf.volume_claim} at {kf.mount_path}{shared}."
        )
    lines += layout_lines(cfg, kf.nodes, per_node)
    return [f"# {line}".rstrip() for line in lines]


def render_trainjob(cfg: RunConfig, overrides: Sequence[str]) -> str:
    """The Kubeflow Trainer TrainJob (YAML) that runs ``distaccum train <overrides>`` on ``kubeflow.nodes`` pods.

    Pure and deterministic. ``overrides`` are the Hydra overrides the user gave; the pods' run_dir is
    :func:`pod_run_dir`. A comment header says what runs (nodes x procs = world, the split, the HSDP or island
    layout) and where run_dir lives. Raises ValueError for a run_dir outside ``kubeflow.mount_path``, a
    ``--config-dir`` override or a split that does not exist on the job's world, and :class:`KubeflowError` when
    the ``kubeflow`` extra is not installed.
    """
    doc = build_trainjob(cfg, overrides).to_dict()
    # Read top-down: what runs (runtime, trainer) before the patch that mounts run_dir's volume.
    first = {key: doc["spec"][key] for key in ("runtimeRef", "trainer") if key in doc["spec"]}
    doc["spec"] = {**first, **doc["spec"]}
    body = yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=1 << 16)
    return "\n".join(_header(cfg, pod_run_dir(cfg))) + "\n" + body


LIGHTHOUSE_PORT = 29510
"""The port of the torchft Lighthouse's Service (torchft's default)."""


def render_ft_trainjobs(cfg: RunConfig, overrides: Sequence[str]) -> str:
    """An ``ft.groups`` run on Kubernetes (pure, as :func:`render_trainjob`): the torchft Lighthouse as a Deployment
    of one pod and a Service (``<kubeflow.name>-lighthouse``), beside one TrainJob per replica group
    (``<kubeflow.name>-g<i>``, its own ``REPLICA_GROUP_ID``, run_dir ``groups/g<i>``). A dead group's pods are
    restarted by its TrainJob's JobSet (the runtime's failure policy); it resumes its checkpoints and heals."""
    kf, ft = cfg.kubeflow, cfg.ft
    host = f"{kf.name}-lighthouse"
    labels = {"app": host}
    meta = {"name": host} | ({"namespace": kf.namespace} if kf.namespace else {})
    lighthouse = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "lighthouse",
                            "image": kf.image,
                            "command": [
                                "torchft_lighthouse",
                                f"--bind=[::]:{LIGHTHOUSE_PORT}",
                                f"--min_replicas={ft.min_groups}",
                                f"--join_timeout_ms={ft.join_timeout_ms}",
                                f"--quorum_tick_ms={ft.quorum_tick_ms}",
                                f"--heartbeat_timeout_ms={ft.heartbeat_timeout_ms}",
                            ],
                            "ports": [{"containerPort": LIGHTHOUSE_PORT}],
                        }
                    ]
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {"selector": labels, "ports": [{"port": LIGHTHOUSE_PORT, "targetPort": LIGHTHOUSE_PORT}]},
    }
    head = [
        f"# ft.groups={ft.groups}: a torchft Lighthouse (Deployment + Service {host}:{LIGHTHOUSE_PORT}, min_replicas="
        f"{ft.min_groups}) and one TrainJob per replica group; a group's failed pods are restarted by its JobSet (set",
        f"# the runtime's failurePolicy.maxRestarts, ft.restarts={ft.restarts} locally): it resumes its checkpoints "
        "and heals from a live group.",
    ]
    docs = [yaml.safe_dump(d, sort_keys=False, width=1 << 16) for d in (lighthouse, service)]
    for g in range(ft.groups):
        env = [*kf.env, f"REPLICA_GROUP_ID={g}", f"TORCHFT_LIGHTHOUSE=http://{host}:{LIGHTHOUSE_PORT}"]
        group = replace(cfg, run_dir=posixpath.join(cfg.run_dir, "groups", f"g{g}"))
        group.kubeflow = replace(kf, name=f"{kf.name}-g{g}", env=env)
        docs.append(render_trainjob(group, overrides))
    return "\n".join(head) + "\n" + "---\n".join(docs)


def submit_trainjob(cfg: RunConfig, overrides: Sequence[str], *, dry_run: bool) -> TrainJobSubmission:
    """Render the TrainJob, write it to ``run_dir/trainjob.yaml`` and ``kubectl apply -f`` it.

    ``run_dir`` is read on this machine here (where the file is kept); the pods use :func:`pod_run_dir`. With
    ``dry_run`` nothing is written or run: the result only carries the YAML. Raises :class:`KubeflowError` when the
    file cannot be written, when ``kubectl`` is not on PATH (the file is written; the message gives the command that
    applies it) or when it refuses the job.
    """
    manifest = render_trainjob(cfg, overrides)
    if dry_run:
        return TrainJobSubmission(manifest=manifest, path=None, applied=None)
    path = (Path(cfg.run_dir) / TRAINJOB_FILE).resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(manifest)
    except OSError as err:  # e.g. an absolute run_dir meant for the pods, not creatable here
        raise KubeflowError(
            f"cannot write {path} on this machine ({err}); --dry-run prints the TrainJob"
        ) from err
    apply = ["kubectl", "apply", "-f", str(path)]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise KubeflowError(
            f"kubectl not found on PATH; wrote {path}: apply it where kubectl reaches the cluster with "
            f"`{shlex.join(apply)}`"
        )
    proc = subprocess.run([kubectl, *apply[1:]], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KubeflowError(f"`{shlex.join(apply)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return TrainJobSubmission(manifest=manifest, path=path, applied=proc.stdout.strip())


class KubeflowLauncher(JobLauncher):
    """``distaccum submit --to kubeflow``: a Kubeflow Trainer TrainJob, ``kubectl apply``-ed."""

    name = "kubeflow"
    summary = "Kubernetes: a Kubeflow Trainer TrainJob, applied with kubectl"
    section = ("kubeflow", KubeflowConfig)
    world_size = staticmethod(kubeflow_world_size)

    @staticmethod
    def render(cfg: RunConfig, overrides: Sequence[str]) -> str:
        return render_ft_trainjobs(cfg, overrides) if cfg.ft.enabled else render_trainjob(cfg, overrides)

    @staticmethod
    def submit(cfg: RunConfig, overrides: Sequence[str]) -> Submitted:
        if cfg.ft.enabled:
            raise KubeflowError(
                f"ft.groups={cfg.ft.groups}: distaccum submit --to kubeflow renders the Lighthouse and the groups' "
                "TrainJobs (--dry-run) but does not apply them: save the dry run and `kubectl apply -f` it"
            )
        result = submit_trainjob(cfg, overrides, dry_run=False)
        note = f"wrote {result.path} and applied it; outputs go to {pod_run_dir(cfg)} in the pods"
        return Submitted(result.applied or "", note)
