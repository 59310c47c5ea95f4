"""Two launcher processes on one machine (--nnodes=2, c10d rendezvous on 127.0.0.1) form one world."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_rendezvous_and_train_as_one_world(tmp_path: Path) -> None:
    run_dir = tmp_path / "two-nodes"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "distaccum", "train", "model=mlp", "trainer.nnodes=2", "trainer.nproc=1",
           f"trainer.rdzv_endpoint=127.0.0.1:{_free_port()}", "trainer.rdzv_id=two-node-test",
           "trainer.max_steps=3", "log.console=quiet", f"run_dir={run_dir}"]
    nodes = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=180) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["accum_steps"] == 4
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["comm_rounds"] == 1 and r["samples"] == 32 for r in records)
