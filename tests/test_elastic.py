"""Elastic torchrun (``trainer.nnodes=MIN:MAX``): two launchers on loopback form one world of 2; one "node" (its
launcher and its worker) is SIGKILLed mid-run. The other's worker fails on the dead gloo peer, its agent restarts
it, it meets the rendezvous alone (world 1, MIN nodes 1), resumes from the last checkpoint with twice the
accumulation steps (the global batch stays 16) and finishes: every optimizer step's record present once, at most
``checkpoint_every`` steps redone, and the final weights equal an uninterrupted world-1 run's to rounding.

Tolerance (fp64, unit roundoff u = 2**-53 = 1.1e-16): each step's gradient sums the same 16 per-sample gradients,
but world 2 adds two all-reduced halves of 8 while world 1 accumulates 4 micro-batches of 4: another order. Summing
n terms in another order moves the sum by at most (n - 1) u sum|g_i| (Higham, Accuracy and Stability, 4.2), < 2e-15
relative for n = 16; AdamW's update m / sqrt(v) inherits errors of that order and moves each weight by at most
lr = 3e-3 a step, so 120 steps differ by < 120 x 3e-3 x 4e-15 = 1.5e-15 absolute unless the training amplifies it.
We allow 1e-12 x max|w| (and 1e-12 relative on each step's loss), >= 100x that bound; a step lost, applied twice or
taken with the wrong K moves them by ~lr (one step fewer: 2.0e-3, measured), ~6e9 times the tolerance.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

import cli_server
import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import distaccum_cli
from distaccum.cluster.local import elastic_lines, free_ports
from distaccum.config import ConfigError, from_mapping
from distaccum.preflight import preflight

N = 120  # optimizer steps (~10 ms each here: enough that the kill lands mid-run)
EVERY = 2  # trainer.checkpoint_every
K2 = 2  # accumulation steps on world 2: 16 = micro-batch 4 x K 2 x 2 ranks; world 1: K 4
COMMON = (
    "model=mlp",
    "precision=fp64",
    "accum.global_batch=16",
    "accum.micro_batch=4",
    "optim.schedule=constant",
    f"trainer.max_steps={N}",
    "trainer.check_every=0",
    "log.console=quiet",
)


def env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PET_NNODES")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def start(run_dir: Path, log: Path, *overrides: str) -> tuple[cli_server.Started, IO[str]]:
    """``distaccum train`` in its own session (so the test can kill its whole process group), output to ``log``."""
    out = log.open("w")
    proc = cli_server.popen(
        ["train", *COMMON, *overrides, f"run_dir={run_dir}"],
        cwd=run_dir.parent,
        env=env(),
        stdout=out,
        stderr=subprocess.STDOUT,
        new_session=True,
    )
    return proc, out


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def rendezvous_host(nodes: list[cli_server.Started], port: int, timeout: float = 120) -> int:
    """Which launcher hosts the c10d rendezvous store (the first to bind ``port``): killing that one would end the
    job for every node (torch's c10d backend), so the test kills the other."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for i, node in enumerate(nodes):
            assert node.poll() is None, f"launcher {i} exited with {node.returncode} before the rendezvous"
            try:
                conns = psutil.Process(node.pid).net_connections("tcp")
            except psutil.NoSuchProcess:
                continue
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in conns):
                return i
        time.sleep(0.05)
    raise AssertionError(f"no launcher listened on the rendezvous port {port}")


def wait_for_world2_checkpoint(run_dir: Path, node: cli_server.Started, timeout: float = 180) -> int:
    """The first optimizer step trained on world 2 (K = K2) whose checkpoint is complete (committed by rename)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and node.poll() is None:
        for r in records(run_dir):
            done = run_dir / "checkpoints" / f"step-{r['step']:08d}"
            if r["micro_steps"] == K2 and r["step"] % EVERY == 0 and done.is_dir() and r["step"] <= N - 20:
                return int(r["step"])
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint on world 2 early enough (records: {records(run_dir)[-3:]})")


def kill_node(node: cli_server.Started) -> list[int]:
    """SIGKILL a node: its launcher's process group and its workers, which torch elastic starts in sessions of
    their own (killing the launcher's group alone would leave them training as orphans). Returns the workers' pids."""
    workers = [p.pid for p in psutil.Process(node.pid).children(recursive=True)]
    os.killpg(node.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return workers


@pytest.mark.unit
@pytest.mark.parametrize(
    "nnodes, kept, worlds", [(2, 2, [4]), ("2", 2, [4]), ("1:3", "1:3", [2, 4, 6]), ("2:2", 2, [4])]
)
def test_nnodes_is_a_count_or_a_range(nnodes: int | str, kept: int | str, worlds: list[int]) -> None:
    cfg = from_mapping({"trainer": {"nnodes": nnodes, "nproc": 2}, "accum": {"global_batch": 48}})
    assert cfg.trainer.nnodes == kept and cfg.world_sizes() == worlds and cfg.world_size() == worlds[-1]


@pytest.mark.unit
@pytest.mark.parametrize(
    "trainer, accum, message",
    [
        ({"nnodes": "3:2"}, {}, "trainer.nnodes=3:2: need 1 <= MIN <= MAX nodes, got MIN=3, MAX=2"),
        ({"nnodes": "0:2"}, {}, "need 1 <= MIN <= MAX nodes, got MIN=0, MAX=2"),
        ({"nnodes": "two"}, {}, "trainer.nnodes must be a number of nodes N or a range MIN:MAX"),
        ({"nnodes": 0}, {}, "need 1 <= MIN <= MAX nodes, got MIN=0, MAX=0"),
        (
            {"nnodes": "1:2"},
            {},
            "trainer.nnodes=1:2 is elastic and needs accum.global_batch: a fixed accum.steps=4",
        ),
        (
            {"nnodes": "1:3", "nproc": 2},
            {"global_batch": 16, "micro_batch": 4},
            "may run on world sizes 2, 4, 6, and accum.global_batch=16 has no split on 6 (accum.micro_batch=4 x "
            "accumulation steps x world size must equal it on each); the nearest global batches that split on all "
            "of them are 48",
        ),
    ],
)
def test_bad_node_ranges_are_refused_in_one_sentence(trainer: dict, accum: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        from_mapping({"trainer": trainer, "accum": accum})
    assert message in str(err.value)


@pytest.mark.unit
def test_the_plan_names_each_world_and_an_elastic_run_checks_every_world(tmp_path: Path) -> None:
    cfg = from_mapping(
        {"trainer": {"nnodes": "1:2", "nproc": 1}, "accum": {"global_batch": 16, "micro_batch": 4}}
    )
    lines = elastic_lines(cfg)
    assert "the world may be 1 or 2 ranks; micro_batch 4 x K=4 on world 1, K=2 on world 2 = 16" in lines[0]
    assert "trainer.max_restarts=0: a node lost mid-run ends the run" in lines[-1]
    assert elastic_lines(from_mapping({"trainer": {"nnodes": 2}})) == []
    gns = from_mapping(
        {
            "trainer": {"nnodes": "1:2", "nproc": 1, "max_restarts": 1},
            "accum": {"global_batch": 16},
            "log": {"gns": True},
            "run_dir": str(tmp_path),
        }
    )
    with pytest.raises(
        ConfigError, match="may continue on 1 node.s., a world of 1, where it cannot run: log.gns"
    ):
        preflight(gns, write=False)


@pytest.mark.dist
@pytest.mark.faults
@pytest.mark.timeout(300)
def test_a_lost_node_resumes_on_the_smaller_world_at_the_same_global_batch(tmp_path: Path) -> None:
    run_dir, reference = tmp_path / "elastic", tmp_path / "reference"
    port = free_ports()[0]
    elastic = (
        "trainer.nnodes=1:2",
        "trainer.nproc=1",
        f"trainer.rdzv_endpoint=127.0.0.1:{port}",
        "trainer.rdzv_id=elastic-test",
        "trainer.rdzv_last_call_s=3",  # the lone survivor waits this long for others before it starts alone
        "trainer.max_restarts=1",
        f"trainer.checkpoint_every={EVERY}",
        "trainer.collective_timeout_s=20",
        "trainer.shutdown_grace_s=5",
    )
    logs = [tmp_path / "node-a.log", tmp_path / "node-b.log"]
    started = [start(run_dir, log, *elastic) for log in logs]
    nodes = [proc for proc, _ in started]
    try:
        host = rendezvous_host(nodes, port)
        survivor, victim = nodes[host], nodes[1 - host]
        checkpointed = wait_for_world2_checkpoint(run_dir, survivor)
        workers = kill_node(victim)
        reached = max(r["step"] for r in records(run_dir))
        ref = distaccum_cli(  # while the survivor waits for the rendezvous to drop the dead node
            ["train", *COMMON, "trainer.nproc=1", f"run_dir={reference}"],
            cwd=tmp_path,
            env=env(),
            timeout=240,
        )
        assert ref.returncode == 0, ref.stderr[-3000:]
        survivor.wait(timeout=240)
    finally:
        for proc, out in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            out.close()
    log = logs[host].read_text()
    assert survivor.returncode == 0, log[-4000:]
    assert victim.returncode == -signal.SIGKILL

    # It resumed from a checkpoint at or after the one seen before the kill, redoing at most checkpoint_every steps.
    resumed = re.findall(r"resumed from \S+ after optimizer step (\d+)(?:; (\d+) step\(s\) finished)?", log)
    assert resumed, log[-4000:]
    done, redone = int(resumed[-1][0]), int(resumed[-1][1] or 0)
    seen = f"checkpoint seen before the kill {checkpointed}, resumed after {done}, reached {reached}"
    assert checkpointed <= done and max(reached - done, 0) <= redone <= EVERY, seen
    assert re.search(
        rf"elastic restart 1: rank \d \(pid ({'|'.join(map(str, workers))}) on \S+\) died", log
    ), log

    got = records(run_dir)
    assert [r["step"] for r in got] == list(range(1, N + 1))  # every step once: none lost, none twice
    assert all(r["samples"] == 16 for r in got)  # the same global batch on both worlds
    after = {r["micro_steps"] for r in got[done:]}
    assert got[done - 1]["micro_steps"] == K2 and after == {
        2 * K2
    }  # world 2 up to the checkpoint, then world 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["accum_steps"]) == (1, 2 * K2)

    want = records(reference)
    for a, b in zip(got, want, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-12, abs=0), a["step"]
    final, straight = (load_file(str(d / "final" / "model.safetensors")) for d in (run_dir, reference))
    assert final.keys() == straight.keys()
    scale = max(t.abs().max().item() for t in straight.values())
    diff = max((final[k] - straight[k]).abs().max().item() for k in final)
    print(
        f"elastic: resumed after step {done}, {redone} step(s) redone; max |w - w_ref| = {diff:.3g} "
        f"(max |w| = {scale:.3g})"
    )
    assert all(t.dtype == torch.float64 for t in final.values())
    assert diff <= 1e-12 * scale
