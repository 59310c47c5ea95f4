"""Each launch contract recognised from its environment (pure), and one clear error when a contract is set in
part (distaccum/runtime/contracts.py)."""

from __future__ import annotations

import pytest

from distaccum.runtime.contracts import ContractError, node_launch, recognize

pytestmark = pytest.mark.unit

TORCHRUN = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "GROUP_RANK": "0",
}
PET = {
    "PET_NNODES": "2",
    "PET_NPROC_PER_NODE": "4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "trainjob-node-0-0.trainjob",
    "PET_MASTER_PORT": "29400",
}


def test_torchrun_worker() -> None:
    contract = recognize(TORCHRUN)
    assert contract.kind == "torchrun" and contract.is_worker
    assert (contract.env.rank, contract.env.world_size, contract.env.node) == (1, 2, 0)


def test_elastic_restart_is_a_torchrun_worker_that_says_so() -> None:
    contract = recognize({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert contract.kind == "elastic_restart" and contract.is_worker and contract.env.restart_count == 2


def test_srun_task() -> None:
    env = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}
    contract = recognize({**env, "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert contract.kind == "slurm" and contract.is_worker and contract.env.master_addr == "n1"


def test_srun_steps_of_jobs_sharing_a_node_meet_on_ports_of_their_own() -> None:
    """Without MASTER_PORT an srun step's ranks rendezvous on a port derived from the job and step ids (every task
    of the step the same), below the kernel's ephemeral range: two jobs on one node no longer meet on one fixed
    port (issue 55: one job's ranks joined another's store and failed in gloo's connectFullMesh)."""
    task = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}

    def port(**env: str) -> int:
        return recognize({**task, **env}).env.master_port

    ports = {
        port(SLURM_JOB_ID=str(job), SLURM_STEP_ID=str(step)) for job in range(100, 200) for step in range(4)
    }
    assert len(ports) == 400 and all(10000 <= p < 20000 for p in ports)
    assert port(SLURM_JOB_ID="7", SLURM_PROCID="1") == port(SLURM_JOB_ID="7")  # the same for every task
    assert port(SLURM_JOB_ID="7", MASTER_PORT="4242") == 4242  # the user's choice wins


def test_kubeflow_pod_is_its_node_launcher() -> None:
    contract = recognize(PET)
    assert contract.kind == "kubeflow" and not contract.is_worker
    launch = contract.node_launch
    assert launch is not None and (launch.node_rank, launch.nproc) == (1, 4)
    assert launch.overrides() == {
        "trainer.nnodes": 2,
        "trainer.nproc": 4,
        "trainer.rdzv_endpoint": "trainjob-node-0-0.trainjob:29400",
    }
    assert node_launch({**PET, "PET_NNODES": "1:3"}).overrides()["trainer.nnodes"] == "1:3"  # type: ignore[union-attr]


def test_the_workers_a_kubeflow_launcher_starts_are_torchrun_workers() -> None:
    assert recognize({**PET, **TORCHRUN}).kind == "torchrun"  # PET_* is inherited, RANK decides


def test_ray_or_a_users_group_is_used_as_it_is() -> None:
    # Ray Train's TorchTrainer initializes the group, then sets the torchrun variables (no TORCHELASTIC_*)
    contract = recognize({**TORCHRUN, "NODE_RANK": "0"}, group_initialized=True)
    assert contract.kind == "initialized_group" and contract.is_worker and contract.env.local_rank == 1
    assert recognize({}, group_initialized=True).kind == "initialized_group"
    # a one-process group a script made itself, LOCAL_RANK set for DeepSpeed: the group decides, nothing is half set
    assert recognize({"LOCAL_RANK": "0"}, group_initialized=True).env.world_size == 1


def test_nothing_set_is_one_process() -> None:
    contract = recognize({"HOME": "/root"})
    assert contract.kind == "single" and not contract.is_worker and contract.env.world_size == 1


@pytest.mark.parametrize(
    "env, names",
    [
        ({"RANK": "0"}, ["RANK set", "WORLD_SIZE missing"]),
        ({"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, ["RANK missing"]),
        ({"RANK": "0", "WORLD_SIZE": "2"}, ["MASTER_ADDR, MASTER_PORT missing"]),
        ({**TORCHRUN, "RANK": "2"}, ["rank 2 is outside a world of 2"]),
        ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}, ["SLURM_NTASKS missing"]),
        ({k: v for k, v in PET.items() if k != "PET_MASTER_ADDR"}, ["PET_MASTER_ADDR missing"]),
        ({**PET, "PET_NODE_RANK": "2"}, ["PET_NODE_RANK=2 with PET_NNODES=2"]),
        ({**PET, "PET_NNODES": "two"}, ["PET_NNODES='two'"]),
        ({**PET, "PET_MASTER_PORT": "x"}, ["PET_MASTER_PORT='x' is not an integer"]),
    ],
)
def test_a_contract_set_in_part_is_one_clear_error(env: dict[str, str], names: list[str]) -> None:
    with pytest.raises(ContractError) as err:
        recognize(env)
    for name in names:
        assert name in str(err.value), str(err.value)


def test_the_cli_refuses_a_half_set_environment_before_composing(tmp_path, monkeypatch, capsys) -> None:
    from distaccum.cli import main

    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["train", f"run_dir={tmp_path}"])
    assert exit_.value.code == 2
    assert "torchrun environment set in part: RANK set but WORLD_SIZE missing" in capsys.readouterr().err
