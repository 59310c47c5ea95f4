"""render_sbatch against golden files, parse_nodelist, and submit's dry run / missing sbatch.

Regenerate the golden files after an intended change with
``DISTACCUM_UPDATE_GOLDEN=1 pytest tests/test_slurm_render.py`` (the rewritten cases fail once),
review the diff, and rerun without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import check_golden
from distaccum.cluster.slurm import SlurmError, parse_nodelist, render_sbatch, submit
from distaccum.config import from_mapping

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden"

# name -> (config mapping, overrides, python)
CASES: dict[str, tuple[dict[str, Any], list[str], str]] = {
    "cpu_1node": (
        {"run_dir": "runs/cpu"},
        ["model=mlp", "trainer.max_steps=3"],
        "python",
    ),
    "gpu_2nodes": (
        {
            "run_dir": "/scratch/runs/gpt",
            "slurm": {
                "nodes": 2,
                "gpus_per_node": 8,
                "cpus_per_task": 32,
                "partition": "gpu",
                "account": "ml-team",
                "time": "04:00:00",
                "job_name": "gpt-fsdp",
                "extra": ["--qos=high", "--exclusive"],
            },
        },
        # A space and a quote show the shell quoting; the stale run_dir is replaced.
        ["engine=fsdp", "precision=bf16", "log.wandb_project=my run", "+note='x'", "run_dir=old"],
        "/opt/venv/bin/python",
    ),
    "hsdp_2nodes": (  # FSDP2 hybrid sharding: the header maps one replica to each node
        {"run_dir": "runs/hsdp", "engine": {"name": "fsdp"}, "trainer": {"nproc": 2}, "slurm": {"nodes": 2}},
        ["engine=fsdp"],
        "python",
    ),
    "cpu_restarts_nosignal": (
        {
            "run_dir": "runs/elastic",
            "trainer": {"nproc": 4, "max_restarts": 1},
            "slurm": {"signal_seconds": 0, "rdzv_port": 29600},
        },
        [],
        "python3",
    ),
    "ft_3groups": (  # torchft replica groups: the Lighthouse step and one restarted step per group
        {
            "run_dir": "/scratch/runs/ft",
            "trainer": {"nproc": 2},
            "accum": {"global_batch": 24, "micro_batch": 2},
            "ft": {"groups": 3, "min_groups": 2, "heartbeat_timeout_ms": 2000, "restarts": 2},
            "slurm": {"nodes": 3},
        },
        ["ft.groups=3", "ft.min_groups=2", "ft.heartbeat_timeout_ms=2000", "ft.restarts=2"],
        "python",
    ),
}


def _render(name: str) -> str:
    mapping, overrides, python = CASES[name]
    return render_sbatch(from_mapping(mapping), overrides, python=python)


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_matches_golden(name: str) -> None:
    check_golden(GOLDEN / f"{name}.sbatch", _render(name))


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_is_valid_bash(name: str) -> None:
    proc = subprocess.run(["bash", "-n", str(GOLDEN / f"{name}.sbatch")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_render_is_deterministic_across_processes() -> None:
    """The iteration order of a set of strings changes with the hash seed; the script must not."""
    here = {name: _render(name) for name in CASES}
    assert here == {name: _render(name) for name in CASES}
    code = (
        "import json, sys; from distaccum.config import from_mapping; from distaccum.cluster.slurm import render_sbatch; "
        "print(json.dumps({name: render_sbatch(from_mapping(m), o, python=p) "
        "for name, (m, o, p) in json.loads(sys.argv[1]).items()}))"
    )
    seeds = ("0", "1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(CASES)],
            text=True,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        for seed in seeds
    ]
    for seed, proc in zip(seeds, procs, strict=True):
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert json.loads(out) == here, f"PYTHONHASHSEED={seed} renders differently"


def test_gpu_count_sets_workers_per_node() -> None:
    text = _render("gpu_2nodes")
    assert "--nproc_per_node=8" in text
    assert "#SBATCH --gpus-per-node=8" in text
    assert "run_dir=old" not in text


@pytest.mark.parametrize("run_dir", ["runs/with space", "runs/%j", ""])
def test_render_rejects_unusable_run_dir(run_dir: str) -> None:
    with pytest.raises(ValueError, match="run_dir"):
        render_sbatch(from_mapping({"run_dir": run_dir}), [])


@pytest.mark.parametrize(
    "slurm",
    [
        {"extra": ["qos=high"]},
        {"signal_seconds": -1},
        {"rdzv_port": 0},
        {"job_name": "my job"},
        {"cpus_per_task": 0},
    ],
)
def test_config_rejects_bad_slurm_fields(slurm: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="slurm"):
        from_mapping({"slurm": slurm})


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("vm", ["vm"]),
        ("", []),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-n[1,3]", ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),
        ("a[1],b[2-3],c", ["a1", "b2", "b3", "c"]),
    ],
)
def test_parse_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize(
    "nodelist", ["node[1-", "node1]", "node[3-1]", "node[a-b]", "node[]", "a,,b", "n[[1]]"]
)
def test_parse_nodelist_rejects_malformed(nodelist: str) -> None:
    with pytest.raises(ValueError, match="nodelist"):
        parse_nodelist(nodelist)


def test_submit_dry_run_writes_and_runs_nothing(tmp_path: Path) -> None:
    cfg = from_mapping({"run_dir": str(tmp_path / "run")})
    result = submit(cfg, ["model=mlp"], dry_run=True)
    assert result.job_id is None and result.script_path is None
    assert result.script == render_sbatch(cfg, ["model=mlp"], python=sys.executable)
    assert not (tmp_path / "run").exists()


def test_submit_without_sbatch_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no sbatch
    cfg = from_mapping({"run_dir": str(tmp_path / "run")})
    with pytest.raises(SlurmError, match="sbatch not found"):
        submit(cfg, [], dry_run=False)


def test_submit_dry_run_shows_the_hsdp_mapping(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from distaccum.cli.submit import submit_main

    assert (
        submit_main(["--dry-run", "slurm.nodes=2", "engine=fsdp", "model=mlp", f"run_dir={tmp_path / 'run'}"])
        == 0
    )
    header = capsys.readouterr().out.split("#SBATCH")[0]
    assert "HSDP: 2 replicas x 2 shards over 2 node(s) of 2 ranks" in header
    assert "replica 0: ranks 0-1 on node 0" in header and "replica 1: ranks 2-3 on node 1" in header


def test_submit_dry_run_shows_one_island_per_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An outer-synced job (issue 47.6): outer.islands=auto puts one island on each Slurm node, and the rendered
    script says so; no HSDP inside an island, even with engine=fsdp."""
    from distaccum.cli.submit import submit_main

    overrides = [
        "--dry-run",
        "slurm.nodes=2",
        "engine=fsdp",
        "model=mlp",
        "outer.method=diloco",
        "outer.every=10",
    ]
    assert submit_main([*overrides, f"run_dir={tmp_path / 'run'}"]) == 0
    header = capsys.readouterr().out.split("#SBATCH")[0]
    assert "outer sync: 2 islands x 2 rank(s) over 2 node(s) of 2 ranks" in header and "HSDP" not in header
    assert "island 0: ranks 0-1 on node 0" in header and "island 1: ranks 2-3 on node 1" in header


def test_a_gpu_job_asks_cpus_for_every_gpu_worker_and_states_its_world_and_interpreter() -> None:
    """Issue 56.9: 8 GPU workers per node were given --cpus-per-task=2; the script did not state the world and the
    global batch, nor that the submitting machine's interpreter must exist on every node."""
    cfg = from_mapping({"run_dir": "/scratch/r", "slurm": {"nodes": 2, "gpus_per_node": 8}})
    script = render_sbatch(cfg, [], python="/home/me/proj/.venv/bin/python")
    assert "#SBATCH --cpus-per-task=64" in script  # slurm.cpus_per_gpu (8) x 8 GPUs
    assert "# 2 node(s) x 8 proc(s) = world 16; micro-batch 4 x K=4 x world 16 = global batch 256" in script
    assert "# Every node runs /home/me/proj/.venv/bin/python (slurm.python): it must exist" in script
    chosen = from_mapping({"run_dir": "/scratch/r", "slurm": {"gpus_per_node": 4, "cpus_per_gpu": 12}})
    assert "#SBATCH --cpus-per-task=48" in render_sbatch(chosen, [])
    cpu = from_mapping({"run_dir": "/scratch/r", "trainer": {"nproc": 6}})
    assert "#SBATCH --cpus-per-task=6" in render_sbatch(cpu, [])  # one per CPU worker
    named = submit(
        from_mapping({"run_dir": "/scratch/r", "slurm": {"python": "/opt/py/bin/python"}}), [], dry_run=True
    )
    assert "srun --kill-on-bad-exit=1 /opt/py/bin/python -m torch.distributed.run" in named.script


def test_ft_job_runs_the_lighthouse_and_restarts_each_group() -> None:
    """ft.groups: the Lighthouse on the first node, group g on its own node with REPLICA_GROUP_ID=g and its own
    rendezvous, restarted up to ft.restarts times, each attempt in its own run directory sharing the first's
    checkpoints; the world the pre-flight checks is one group's; uneven nodes are refused with the reason. (A real job
    on the local Slurm: tests/test_slurm_cluster.py.)"""
    from distaccum.cluster.slurm import SlurmLauncher

    text = _render("ft_3groups")
    assert (
        "torchft_lighthouse '--bind=[::]:29510' --min_replicas=2" in text
        and "--heartbeat_timeout_ms=2000" in text
    )
    assert (
        'REPLICA_GROUP_ID="$g",DISTACCUM_FT_RESTART="$attempt",TORCHFT_LIGHTHOUSE="http://$head_node:29510"'
        in text
    )
    assert 'local dir=/scratch/runs/ft/groups/g"$g"-a"$attempt"' in text and 'run_dir="$dir"' in text
    assert 'ln -sfn ../g"$g"-a0/checkpoints "$dir/checkpoints"' in text and '[ "$attempt" -gt 2 ]' in text
    assert "export RUST_LOG=${RUST_LOG:-warn}" in text and "--overlap \\" not in text  # a node per group
    assert "#SBATCH --no-kill" in text and "--signal" not in text
    cfg = from_mapping(CASES["ft_3groups"][0])
    assert SlurmLauncher.world(cfg).ranks == 2
    with pytest.raises(ValueError, match="multiple of 3"):
        render_sbatch(from_mapping({**CASES["ft_3groups"][0], "slurm": {"nodes": 4}}), [])
    # Groups sharing a node: each overlaps there with its share of the node's workers and its own GPUs.
    shared = render_sbatch(
        from_mapping({**CASES["ft_3groups"][0], "slurm": {"nodes": 1, "gpus_per_node": 6}}), []
    )
    assert '--nodes=1 --ntasks=1 --relative="$first_index" --overlap' in shared
    assert "--nproc_per_node=2" in shared and "first_index=$(($1 / 3 * 1))" in shared
    assert "local devices=$(seq -s, $(($1 % 3 * 2)) $(($1 % 3 * 2 + 1)))" in shared
    assert ',CUDA_VISIBLE_DEVICES="$devices"' in shared
    with pytest.raises(ValueError, match="equal share of one"):  # 2 groups cannot share 3 GPUs
        render_sbatch(
            from_mapping(
                {**CASES["ft_3groups"][0], "ft": {"groups": 2}, "slurm": {"nodes": 1, "gpus_per_node": 3}}
            ),
            [],
        )


def test_submit_dry_run_renders_replica_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`distaccum submit --dry-run` of an ft run renders (the pre-flight checks one group's world), no longer refused."""
    from distaccum.cli.submit import submit_main

    args = ["slurm.nodes=2", "ft.groups=2", "trainer.nproc=1", "model=mlp", f"run_dir={tmp_path / 'run'}"]
    assert submit_main(["--dry-run", *args]) == 0
    out = capsys.readouterr().out
    assert "torchft_lighthouse" in out and "--nproc_per_node=1" in out and "'ft.groups=2'" not in out
