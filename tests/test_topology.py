"""DistEnv is a pure function of an environment mapping."""

from __future__ import annotations

import os

import pytest

from distaccum.runtime.contracts import DistEnv, first_host, recognize

pytestmark = pytest.mark.unit


def test_torchrun_variables() -> None:
    ranks = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    master = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    env = DistEnv.from_environ({**ranks, **master, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert (env.rank, env.world_size, env.local_rank, env.node_rank) == (3, 4, 1, 1)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)
    assert (env.source, env.restart_count) == ("torchrun", 1)
    assert env.init_env()["WORLD_SIZE"] == "4"


def test_srun_variables_pick_first_node_as_master() -> None:
    tasks = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}
    env = DistEnv.from_environ(
        {**tasks, "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]"}
    )
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    assert env.master_addr == "gpu07" and env.source == "slurm" and env.node_rank == 1


def test_batch_script_and_plain_shell_are_not_workers() -> None:
    assert not recognize({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7"}).is_worker
    assert not recognize({}).is_worker
    assert DistEnv.from_environ({}).source == "single"


@pytest.mark.parametrize(
    "nodelist, head",
    [("node01", "node01"), ("node[03-05,09],gpu1", "node03"), ("a[1,2]", "a1"), ("x-y[010-012]", "x-y010")],
)
def test_first_host(nodelist: str, head: str) -> None:
    assert first_host(nodelist) == head


def test_torchrun_argv_renders_the_equivalent_launch() -> None:
    from pathlib import Path

    from distaccum.cluster.local import launch_recipe, torchrun_argv, worker_args
    from distaccum.config import from_mapping

    cfg = from_mapping(
        {
            "trainer": {
                "nproc": 4,
                "nnodes": 2,
                "rdzv_endpoint": "node01:29500",
                "rdzv_id": "exp",
                "max_restarts": 1,
            }
        }
    )
    assert torchrun_argv(
        launch_recipe(cfg), worker_args(Path("run/launch_config.json")), python="python"
    ) == [
        "python",
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=4",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node01:29500",
        "--rdzv_id=exp",
        "--max_restarts=1",
        "-m",
        "distaccum",
        "_worker",
        "run/launch_config.json",
    ]
    single = from_mapping({"trainer": {"nproc": 2}})
    assert "--rdzv_endpoint=127.0.0.1:0" in torchrun_argv(launch_recipe(single), ["examples/own_loop.py"])
    elastic = from_mapping(
        {
            "trainer": {"nnodes": "1:2", "rdzv_endpoint": "node01:29500", "rdzv_last_call_s": 5},
            "accum": {"global_batch": 16},
        }
    )
    assert torchrun_argv(launch_recipe(elastic), ["train.py"], python="python")[3:9] == [
        "--nnodes=1:2",
        "--nproc_per_node=2",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node01:29500",
        "--rdzv_id=distaccum",
        "--rdzv_conf=last_call_timeout=5",
    ]


def test_an_elastic_launch_announces_its_rendezvous_wait_and_refuses_an_outer_sync() -> None:
    """Issue 56.8: after the elastic lines the launcher waited the rendezvous' last call in silence; and an elastic
    outer-synced run started, though a lost node changes the island count, which its resume then refuses."""
    from distaccum.cluster.local import elastic_lines
    from distaccum.config import from_mapping

    elastic = {"trainer": {"nnodes": "1:2", "rdzv_last_call_s": 5}, "accum": {"global_batch": 16}}
    lines = elastic_lines(from_mapping(elastic))
    assert (
        "elastic: waiting now at the rendezvous for 1 node(s), then up to trainer.rdzv_last_call_s=5 s more for up "
        "to 2 before the workers start"
    ) in lines
    with pytest.raises(
        ValueError, match="outer.method=diloco cannot follow: a lost node changes the island count"
    ):
        from_mapping({**elastic, "outer": {"method": "diloco"}})


def test_cpu_workers_tell_deepspeed_there_is_no_gpu_to_detect(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from distaccum.cluster.local import worker_environment

    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    env = worker_environment(2)
    assert env.get("DS_ACCELERATOR") == (None if torch.cuda.is_available() else "cpu")
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # the user's choice is kept
    assert "DS_ACCELERATOR" not in worker_environment(2)
