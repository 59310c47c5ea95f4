"""render_trainjob against golden files, the YAML read back by the Kubeflow Trainer API's models, the pods' command
composed back by distaccum's Hydra composition, the kubeflow.* checks, and submit_trainjob's dry run, missing
kubectl and kubectl apply (a stand-in kubectl first on PATH that records its arguments).

Regenerate the golden files after an intended change with
``DISTACCUM_UPDATE_GOLDEN=1 pytest tests/test_kubeflow_render.py`` (the rewritten cases fail once),
review the diff, and rerun without it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import check_golden, requires
from distaccum.cli.compose import compose_config
from distaccum.cluster.kubeflow import (
    KubeflowError,
    build_trainjob,
    kubeflow_world_size,
    pod_run_dir,
    render_trainjob,
    submit_trainjob,
    train_command,
)
from distaccum.config import ConfigError, from_mapping
from distaccum.engines import engine_class

models = requires("kubeflow_trainer_api.models")
# Imported while collecting, like the models above: the FSDP2 engine module's first import (torch.distributed.fsdp,
# about a second) is a one-time cost of the process, not of rendering; the HSDP cases below ask for its class.
engine_class("fsdp")

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden"

GPU_PVC: dict[str, Any] = {
    "run_dir": "gpt",
    "engine": {"name": "fsdp"},
    "precision": "bf16",
    "accum": {"micro_batch": 4, "global_batch": 256},
    "kubeflow": {
        "name": "gpt-fsdp",
        "namespace": "ml-team",
        "image": "registry.example.com/distaccum:cuda",
        "nodes": 2,
        "gpus_per_node": 8,
        "cpus_per_node": "32",
        "memory_per_node": "200Gi",
        "volume_claim": "runs-pvc",
        "env": ["WANDB_MODE=offline"],
    },
}

# name -> (config mapping, overrides)
CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "trainjob_cpu": ({"run_dir": "runs/cpu"}, ["model=mlp", "trainer.max_steps=3"]),
    "trainjob_gpu_pvc": (
        GPU_PVC,
        # A space stays one argument (no shell runs the command); the stale run_dir is replaced.
        [
            "engine=fsdp",
            "precision=bf16",
            "accum.global_batch=256",
            "log.wandb_project=my run",
            "run_dir=old",
        ],
    ),
}


def _render(name: str) -> str:
    mapping, overrides = CASES[name]
    return render_trainjob(from_mapping(mapping), overrides)


def _header(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("#")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_matches_golden(name: str) -> None:
    check_golden(GOLDEN / f"{name}.yaml", _render(name))


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_reads_back_into_the_trainjob_model(name: str) -> None:
    """Every field of the YAML is one the API has: the model drops unknown fields on reading, so a misspelt or
    invented one would be missing from what it writes back."""
    doc = yaml.safe_load((GOLDEN / f"{name}.yaml").read_text())
    job = models.TrainerV1alpha1TrainJob.from_dict(doc)
    assert job.to_dict() == doc
    mapping, overrides = CASES[name]
    assert job.to_dict() == build_trainjob(from_mapping(mapping), overrides).to_dict()
    assert (doc["apiVersion"], doc["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert doc["spec"]["runtimeRef"] == {
        "apiGroup": "trainer.kubeflow.org",
        "kind": "ClusterTrainingRuntime",
        "name": "torch-distributed",
    }


def test_gpu_job_asks_each_node_for_its_gpus_and_mounts_the_claim() -> None:
    doc = yaml.safe_load(_render("trainjob_gpu_pvc"))
    trainer = doc["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (2, 8)
    want = {"cpu": "32", "memory": "200Gi", "nvidia.com/gpu": "8"}
    assert trainer["resourcesPerNode"] == {"limits": want, "requests": want}
    assert trainer["command"][:2] == ["distaccum", "train"] and trainer["command"][-1] == "run_dir=/runs/gpt"
    assert "run_dir=old" not in trainer["command"] and "log.wandb_project=my run" in trainer["command"]
    assert trainer["env"] == [
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "WANDB_MODE", "value": "offline"},
    ]
    assert doc["metadata"] == {"name": "gpt-fsdp", "namespace": "ml-team"}
    (patch,) = doc["spec"]["runtimePatches"]
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = job["template"]["spec"]["template"]["spec"]
    assert job["name"] == "node" and pod["containers"] == [
        {"name": "node", "volumeMounts": [{"name": "run-dir", "mountPath": "/runs"}]}
    ]
    assert pod["volumes"] == [{"name": "run-dir", "persistentVolumeClaim": {"claimName": "runs-pvc"}}]


def test_a_gpu_pod_asks_cpus_and_memory_for_each_gpu() -> None:
    """Issue 56.9: beside nvidia.com/gpu: '8' the TrainJob asked cpu '2' and memory 8Gi."""
    from distaccum.cluster.kubeflow import node_resources

    gpu = from_mapping({"kubeflow": {"gpus_per_node": 8}})
    assert node_resources(gpu) == {"cpu": "64", "memory": "512Gi"}
    chosen = from_mapping({"kubeflow": {"gpus_per_node": 4, "cpus_per_gpu": 12, "memory_per_gpu": "1.5Ti"}})
    assert node_resources(chosen) == {"cpu": "48", "memory": "6Ti"}
    assert node_resources(from_mapping({"trainer": {"nproc": 4}})) == {"cpu": "4", "memory": "8Gi"}


def test_header_says_what_runs() -> None:
    header = _header(_render("trainjob_gpu_pvc"))
    assert "# 2 node(s) x 8 proc(s) = world 16; micro-batch 4 x K=4 x world 16 = global batch 256" in header
    assert not any("WARNING" in line for line in header)
    assert any("PersistentVolumeClaim runs-pvc" in line and "ReadWriteMany" in line for line in header)
    assert any(line.startswith("# HSDP: 2 replicas x 8 shards over 2 node(s) of 8 ranks") for line in header)
    assert "#   replica 1: ranks 8-15 on node 1" in header


def test_without_a_claim_the_top_says_checkpoints_are_lost() -> None:
    text = _render("trainjob_cpu")
    assert text.startswith(
        "# WARNING: no kubeflow.volume_claim: run_dir /runs/runs/cpu lives on the pod's own disk"
    )
    assert "a restarted pod loses its checkpoints" in " ".join(_header(text))
    pod = yaml.safe_load(text)["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
    assert pod["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["volumes"] == [
        {"name": "run-dir", "emptyDir": {}}
    ]
    two_pods = render_trainjob(from_mapping({"kubeflow": {"nodes": 2}}), [])
    assert "no checkpoint is whole" in " ".join(_header(two_pods))


def test_island_plan_replaces_hsdp_for_an_outer_synced_job() -> None:
    cfg = from_mapping(
        {"engine": {"name": "fsdp"}, "outer": {"method": "diloco", "every": 10}, "kubeflow": {"nodes": 2}}
    )
    header = " ".join(_header(render_trainjob(cfg, [])))
    assert "outer sync: 2 islands x 2 rank(s) over 2 node(s) of 2 ranks" in header and "HSDP" not in header


def test_auto_micro_batch_is_left_to_the_workers() -> None:
    cfg = from_mapping({"accum": {"micro_batch": "auto", "global_batch": 64}, "kubeflow": {"nodes": 2}})
    assert "micro-batch auto (measured when training starts) x K = global batch 64" in render_trainjob(
        cfg, []
    )


def test_a_split_missing_on_the_jobs_world_is_a_value_error() -> None:
    cfg = from_mapping({"accum": {"micro_batch": 4, "global_batch": 32}, "kubeflow": {"gpus_per_node": 3}})
    with pytest.raises(ValueError, match="no split on world_size=3"):
        render_trainjob(cfg, [])


@pytest.mark.parametrize(
    ("kubeflow", "trainer", "world"),
    [({}, {}, 2), ({"nodes": 3}, {"nproc": 4}, 12), ({"nodes": 2, "gpus_per_node": 8}, {"nproc": 4}, 16)],
)
def test_world_size_is_nodes_times_procs_per_node(
    kubeflow: dict[str, Any], trainer: dict[str, Any], world: int
) -> None:
    cfg = from_mapping({"kubeflow": kubeflow, "trainer": trainer})
    assert kubeflow_world_size(cfg) == world
    assert (
        yaml.safe_load(render_trainjob(cfg, []))["spec"]["trainer"]["numProcPerNode"]
        == world // cfg.kubeflow.nodes
    )


def test_the_pods_command_composes_back_to_the_submitted_config() -> None:
    """The overrides given to `distaccum submit --to kubeflow` and the command it renders compose, through
    distaccum's own Hydra composition, to the same config, run_dir aside (pinned under the mount)."""
    given = [
        "model=mlp",
        "engine=fsdp",
        "accum.micro_batch=2",
        "log.wandb_project=my run",
        "kubeflow.nodes=2",
        "kubeflow.cpus_per_node=32",  # Hydra reads an int: the config keeps a quantity string
        "kubeflow.volume_claim=runs-pvc",
        "run_dir=exp42",
    ]
    cfg = compose_config(given)
    assert cfg.kubeflow.cpus_per_node == "32"
    command = yaml.safe_load(render_trainjob(cfg, given))["spec"]["trainer"]["command"]
    assert command[:2] == ["distaccum", "train"]
    assert compose_config(command[2:]) == dataclasses.replace(cfg, run_dir="/runs/exp42")


@pytest.mark.parametrize(
    ("run_dir", "mount", "pod"),
    [
        ("exp", "/runs", "/runs/exp"),
        ("a/./b/", "/data/x", "/data/x/a/b"),
        ("/runs/exp", "/runs", "/runs/exp"),
    ],
)
def test_run_dir_is_pinned_under_the_mount(run_dir: str, mount: str, pod: str) -> None:
    assert pod_run_dir(from_mapping({"run_dir": run_dir, "kubeflow": {"mount_path": mount}})) == pod


@pytest.mark.parametrize("run_dir", ["/scratch/exp", "../exp", "/runsx/exp", ""])
def test_run_dir_outside_the_mount_is_refused(run_dir: str) -> None:
    with pytest.raises(ValueError, match="run_dir=.*kubeflow.mount_path='/runs'"):
        render_trainjob(from_mapping({"run_dir": run_dir}), [])


def test_command_replaces_run_dir_and_refuses_local_config_dirs() -> None:
    cfg = from_mapping({"run_dir": "exp"})
    assert train_command(cfg, ["run_dir=a", "+run_dir=b", "model=mlp", "log.note=run_dir=x"]) == [
        "distaccum",
        "train",
        "model=mlp",
        "log.note=run_dir=x",
        "run_dir=/runs/exp",
    ]
    for overrides in (["--config-dir", "mine"], ["--config-dir=mine"], ["-cd", "mine"]):
        with pytest.raises(ValueError, match="pods do not see this machine's directories"):
            train_command(cfg, overrides)


def test_kubeflow_env_wins_over_the_defaults() -> None:
    cfg = from_mapping({"kubeflow": {"env": ["PYTHONUNBUFFERED=0", "A=x=y"]}})
    env = yaml.safe_load(render_trainjob(cfg, []))["spec"]["trainer"]["env"]
    assert env == [{"name": "PYTHONUNBUFFERED", "value": "0"}, {"name": "A", "value": "x=y"}]


@pytest.mark.parametrize(
    ("kubeflow", "message"),
    [
        ({"name": "GPT"}, "kubeflow.name='GPT' must be a TrainJob name"),
        ({"name": "1job"}, "kubeflow.name='1job'"),  # the TrainJob CRD wants a letter first (RFC 1035)
        ({"name": "a" * 64}, "at most 63"),
        ({"namespace": "ML"}, "kubeflow.namespace='ML'"),
        ({"runtime": ""}, "kubeflow.runtime=''"),
        ({"volume_claim": "my_claim"}, "kubeflow.volume_claim='my_claim'"),
        ({"image": "my image"}, "kubeflow.image='my image'"),
        ({"nodes": 0}, "kubeflow.nodes must be >= 1, got 0"),
        ({"gpus_per_node": -1}, "kubeflow.gpus_per_node must be >= 0"),
        ({"cpus_per_node": "two"}, "kubeflow.cpus_per_node='two' must be a positive Kubernetes quantity"),
        ({"cpus_per_node": 0}, "kubeflow.cpus_per_node=0 must be a positive"),
        ({"memory_per_node": "8GB"}, "kubeflow.memory_per_node='8GB'"),
        ({"mount_path": "runs"}, "kubeflow.mount_path must be an absolute directory"),
        ({"mount_path": "/"}, "kubeflow.mount_path must be an absolute directory other than '/'"),
        ({"env": ["WANDB_MODE"]}, "kubeflow.env entry 'WANDB_MODE' must be NAME=VALUE"),
        ({"env": ["PET_NNODES=2"]}, "the torch runtime sets PET_"),
        ({"env": ["A=1", "A=2"]}, "kubeflow.env sets A twice"),
    ],
)
def test_bad_kubeflow_values_are_one_clear_error(kubeflow: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as err:
        from_mapping({"kubeflow": kubeflow})
    assert message in str(err.value)


def test_bad_kubeflow_value_from_the_command_line_is_a_config_error() -> None:
    with pytest.raises(
        ConfigError, match="kubeflow.memory_per_node='lots' must be a positive Kubernetes quantity"
    ):
        compose_config(["kubeflow.memory_per_node=lots"])


def test_quantities_keep_their_notation() -> None:
    kf = from_mapping({"kubeflow": {"cpus_per_node": "500m", "memory_per_node": "1.5Gi"}}).kubeflow
    assert (kf.cpus_per_node, kf.memory_per_node) == ("500m", "1.5Gi")
    assert from_mapping({"kubeflow": {"cpus_per_node": 0.5}}).kubeflow.cpus_per_node == "0.5"


def test_missing_kubeflow_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kubeflow_trainer_api", None)  # import fails as if not installed
    with pytest.raises(KubeflowError, match=r'pip install "distaccum\[kubeflow\]"'):
        render_trainjob(from_mapping({}), [])


def test_submit_dry_run_writes_and_runs_nothing(tmp_path: Path) -> None:
    cfg = from_mapping({"run_dir": str(tmp_path / "runs" / "exp"), "kubeflow": {"mount_path": str(tmp_path)}})
    result = submit_trainjob(cfg, ["model=mlp"], dry_run=True)
    assert (result.path, result.applied) == (None, None)
    assert result.manifest == render_trainjob(cfg, ["model=mlp"])
    assert not (tmp_path / "runs").exists()


def test_submit_without_kubectl_writes_the_file_and_says_how_to_apply_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # a real PATH with no kubectl on it
    cfg = from_mapping({"run_dir": str(tmp_path / "run"), "kubeflow": {"mount_path": str(tmp_path)}})
    path = tmp_path / "run" / "trainjob.yaml"
    with pytest.raises(KubeflowError) as err:
        submit_trainjob(cfg, [], dry_run=False)
    assert "kubectl not found on PATH" in str(err.value)
    assert f"wrote {path}" in str(err.value) and f"`kubectl apply -f {path}`" in str(err.value)
    assert path.read_text() == render_trainjob(cfg, [])


def _fake_kubectl(bin_dir: Path, *, exit_code: int = 0) -> Path:
    """A kubectl that records its arguments (one a line) next to itself and answers like kubectl apply."""
    record = bin_dir / "kubectl.argv"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "kubectl"
    script.write_text(
        "#!/bin/sh\n"
        f"printf '%s\\n' \"$@\" > '{record}'\n"
        + (
            'echo "trainjob.trainer.kubeflow.org/distaccum created"\n'
            if exit_code == 0
            else 'echo "error: no matches for kind TrainJob" >&2\n'
        )
        + f"exit {exit_code}\n"
    )
    script.chmod(0o755)
    return record


def test_submit_applies_the_written_file_with_kubectl(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = _fake_kubectl(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg = from_mapping({"run_dir": str(tmp_path / "run"), "kubeflow": {"mount_path": str(tmp_path)}})
    result = submit_trainjob(cfg, ["model=mlp"], dry_run=False)
    path = tmp_path / "run" / "trainjob.yaml"
    assert record.read_text().splitlines() == ["apply", "-f", str(path)]
    assert result.path == path and result.applied == "trainjob.trainer.kubeflow.org/distaccum created"
    assert path.read_text() == result.manifest == render_trainjob(cfg, ["model=mlp"])


def test_submit_reports_kubectls_refusal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_kubectl(tmp_path / "bin", exit_code=1)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    cfg = from_mapping({"run_dir": str(tmp_path / "run"), "kubeflow": {"mount_path": str(tmp_path)}})
    with pytest.raises(KubeflowError, match=r"failed \(exit 1\): error: no matches for kind TrainJob"):
        submit_trainjob(cfg, [], dry_run=False)


def test_submit_where_run_dir_cannot_be_made_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")  # run_dir below a regular file: no directory can be made there
    cfg = from_mapping({"run_dir": str(tmp_path / "file" / "run"), "kubeflow": {"mount_path": str(tmp_path)}})
    with pytest.raises(KubeflowError, match=r"cannot write .*trainjob\.yaml on this machine .*--dry-run"):
        submit_trainjob(cfg, [], dry_run=False)


def test_distaccum_submit_to_kubeflow_dry_run_prints_the_trainjob(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's command: `distaccum submit --to kubeflow --dry-run ...` pre-flights at the job's world (2 nodes x 2
    processes) and prints the TrainJob; nothing is written."""
    from distaccum.cli.submit import submit_main

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "exp"
    argv = ["--to", "kubeflow", "--dry-run", "kubeflow.nodes=2", "model=mlp", "accum.global_batch=32"]
    assert submit_main([*argv, "run_dir=exp"]) == 0
    out = capsys.readouterr().out
    assert "run_dir=/runs/exp" in out
    assert "2 node(s) x 2 proc(s) = world 4; micro-batch 4 x K=2 x world 4 = global batch 32" in out
    assert "kind: TrainJob" in out and "numNodes: 2" in out and not run_dir.exists()
    assert submit_main(["--to", "kubeflow", "--dry-run", "kubeflow.nodes=3", "accum.global_batch=32"]) == 2
    err = capsys.readouterr().err  # 32 does not split over 3 x 2 ranks: said before rendering
    assert "accum.global_batch=32 has no split on world_size=6 ranks" in err


def test_ft_renders_the_lighthouse_beside_one_trainjob_per_group() -> None:
    """ft.groups on Kubernetes: a Lighthouse Deployment and Service, then one TrainJob per replica group (each reads
    back into the TrainJob model) with its REPLICA_GROUP_ID, the Lighthouse's address and its own run_dir."""
    from distaccum.cluster.kubeflow import KubeflowLauncher

    cfg = from_mapping(
        {"run_dir": "ft", "accum": {"global_batch": 24, "micro_batch": 2}, "ft": {"groups": 2}}
    )
    docs = list(yaml.safe_load_all(KubeflowLauncher.render(cfg, ["ft.groups=2"])))
    assert [d["kind"] for d in docs] == ["Deployment", "Service", "TrainJob", "TrainJob"]
    assert docs[0]["spec"]["template"]["spec"]["containers"][0]["command"][0] == "torchft_lighthouse"
    for g, doc in enumerate(docs[2:]):
        assert models.TrainerV1alpha1TrainJob.from_dict(doc).to_dict() == doc
        env = {e["name"]: e["value"] for e in doc["spec"]["trainer"]["env"]}
        assert (
            env["REPLICA_GROUP_ID"] == str(g)
            and env["TORCHFT_LIGHTHOUSE"] == "http://distaccum-lighthouse:29510"
        )
        assert doc["metadata"]["name"] == f"distaccum-g{g}"
        assert doc["spec"]["trainer"]["command"][-1] == f"run_dir=/runs/ft/groups/g{g}"
