"""Two launcher processes on one machine (--nnodes=2, c10d rendezvous on 127.0.0.1) form one world: FSDP2 hybrid
sharding with 2 ranks per "node" puts one replica on each node (engine.replicas=auto), each shard group within
one node, as the launcher's plan said; an outer-synced run puts one island on each node (outer.islands=auto)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import cli_server
import pytest

from conftest import distaccum_cli
from distaccum.cluster.local import free_ports

pytestmark = pytest.mark.dist


def two_nodes(run_dir: Path, *overrides: str) -> list[tuple[str, str]]:
    """Two launchers of 2 ranks each on loopback forming one world of 4; their (stdout, stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [
        sys.executable,
        "-m",
        "distaccum",
        "train",
        "model=mlp",
        *overrides,
        "trainer.nnodes=2",
        "trainer.nproc=2",
        f"trainer.rdzv_endpoint=127.0.0.1:{free_ports()[0]}",
        "trainer.rdzv_id=two-node-test",
        "accum.steps=2",
        "trainer.max_steps=2",
        "log.console=quiet",
        f"run_dir={run_dir}",
    ]
    nodes = [
        subprocess.Popen(
            cmd, cwd=run_dir.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=240) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    return outputs


def test_two_nodes_rendezvous_and_train_hsdp_with_one_replica_per_node(tmp_path: Path) -> None:
    run_dir = tmp_path / "two-nodes"
    outputs = two_nodes(run_dir, "engine=fsdp")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["replicas"] == 2 and summary["sync"] == "replica_boundary"
    placement = summary["placement"]  # every rank's node as its launcher numbered it (GROUP_RANK)
    assert placement["groups"] == [[0, 1], [2, 3]] and sorted(placement["nodes"]) == [0, 0, 1, 1]
    for group in placement["groups"]:
        assert len({placement["nodes"][rank] for rank in group}) == 1, placement  # a shard group is one node
    assert placement["nodes"][0] != placement["nodes"][2]  # the replicas sit on different nodes
    printed = "".join(out for out, _ in outputs)
    assert "replica 0: ranks 0-1 on node 0" in printed and "replica 1: ranks 2-3 on node 1" in printed
    for out, _ in outputs:  # every node's launcher ends with its own workers' exit (issue 56.8)
        assert out.rstrip().endswith("distaccum: this node's workers exited 0 (ok)"), out[-500:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(
        r["comm_rounds"] == 2 and r["comm_rounds_replicate"] == 1 and r["samples"] == 32 for r in records
    )


def test_two_nodes_make_one_island_each_for_an_outer_synced_run(tmp_path: Path) -> None:
    """outer.islands=auto on a 2-node launch: one island per node, so every step's reduction stays in a node and
    only the outer sync crosses between them (issue 47.6), as the launcher's plan says."""
    run_dir = tmp_path / "islands"
    outputs = two_nodes(run_dir, "engine=ddp", "outer.method=diloco", "outer.every=1")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["outer"]["islands"] == 2 and summary["outer"]["syncs"] == 2
    placement = summary["placement"]
    assert placement["groups"] == [[0, 1], [2, 3]] and sorted(placement["nodes"]) == [0, 0, 1, 1]
    for group in placement["groups"]:
        assert len({placement["nodes"][rank] for rank in group}) == 1, placement  # an island is one node
    printed = "".join(out for out, _ in outputs)
    assert "island 0: ranks 0-1 on node 0" in printed and "island 1: ranks 2-3 on node 1" in printed
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["comm_calls_outer"] == 1 and r["comm_calls_replicate"] == 0 for r in records)


def test_two_pods_given_kubeflows_pet_environment_train_as_one_launch(tmp_path: Path) -> None:
    """Exactly the environment Kubeflow Trainer's torch runtime injects into each node's pod (PET_*: 2 nodes of 1
    process, node ranks 0 and 1, the master on loopback), given to two `distaccum train` launchers: they meet, train
    one world of 2 and match, bit for bit in fp64, a single launcher of 2 processes on the same global batch."""
    common = [
        "model=mlp",
        "precision=fp64",
        "accum.global_batch=32",
        "accum.micro_batch=4",
        "trainer.max_steps=3",
        "log.console=quiet",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    pods_dir, single_dir = tmp_path / "pods", tmp_path / "single"
    port = free_ports()[0]
    pods = [
        cli_server.popen(
            ["train", *common, f"run_dir={pods_dir}"],
            cwd=tmp_path,
            env={
                **env,
                "PET_NNODES": "2",
                "PET_NPROC_PER_NODE": "1",
                "PET_NODE_RANK": str(node),
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for node in range(2)
    ]
    outputs = [pod.communicate(timeout=240) for pod in pods]
    for pod, (_, err) in zip(pods, outputs, strict=True):
        assert pod.returncode == 0, err[-3000:]
    for node, (out, _) in enumerate(outputs):  # each pod's launcher read its own PET_*
        assert f"node {node} of 2, 1 worker(s) here, rendezvous at 127.0.0.1:{port}" in out, out
    single = distaccum_cli(
        ["train", *common, "trainer.nproc=2", f"run_dir={single_dir}"], cwd=tmp_path, env=env, timeout=240
    )
    assert single.returncode == 0, single.stderr[-3000:]

    def records(run_dir: Path) -> list[dict]:
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    pods_summary = json.loads((pods_dir / "summary.json").read_text())
    assert (pods_summary["world_size"], pods_summary["accum_steps"]) == (2, 4)  # 4 x K=4 x 2 ranks = 32
    assert [r["micro_steps"] for r in records(pods_dir)] == [4, 4, 4]
    assert [r["loss"] for r in records(pods_dir)] == [r["loss"] for r in records(single_dir)]
    single_summary = json.loads((single_dir / "summary.json").read_text())
    assert pods_summary["param_sum"] == single_summary["param_sum"]
