"""FSDP2 hybrid sharding (HSDP) end to end: 2 replicas x 2 shards on 4 gloo processes.

- ``distaccum verify engine=fsdp engine.replicas=2 trainer.nproc=4 accum.sync=MODE`` passes at fp64 (<= 1e-9)
  in each of the three modes on a user component (tests/fixtures/mytask.py), and at fp32 on a Hugging Face
  causal LM (replica_boundary); with ``accum.reduce_dtype=bf16`` at fp32 within the derived tolerance, the
  ledger's bytes 2 per gradient element (fp32: 4) in both groups.
- The ledger's per-group counts, per step: cross-replica all-reduce rounds 1 for ``boundary`` and
  ``replica_boundary``, K for ``every_micro`` (FSDP2 issues one all-reduce per unit, so calls = rounds x units).
- The final weights reload bit for bit to the summary's ``param_sum``; ``placement`` names the shard groups.
- Faults tier: a killed rank restarts the group from an HSDP checkpoint (DCP) bit for bit, and the checkpoint
  resumes on another world size (2 ranks, flat FSDP).

Kept small for 2 cores: 2 steps of K=2 on the smallest models; each mode is one 4-process verify.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from test_faults import rank_pid, run, start, steps, summary, wait_for_step

from conftest import Run, requires, run_cli
from distaccum.rundir.weights import load_weights
from hf_corpus import OFFLINE

pytestmark = [
    pytest.mark.dist,
    pytest.mark.filterwarnings("ignore:`torch.distributed.*is deprecated:FutureWarning"),
]

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ENV = {
    **OFFLINE,
    "PYTHONPATH": os.pathsep.join(p for p in (str(FIXTURES), os.environ.get("PYTHONPATH")) if p),
}
"""mytask and hf_llama importable in the workers (and offline Hugging Face)."""
USER = ("--config-dir", str(FIXTURES / "conf"), "model=mytask", "data=mytask", "loss=mytask")
HSDP = ("engine=fsdp", "engine.replicas=2", "trainer.nproc=4")
K = 2
SMALL = ("accum.micro_batch=2", f"accum.steps={K}", "trainer.max_steps=2")
UNITS = 2  # mytask.Net: two Linear layers, each its own FSDP unit; the root keeps no parameter of its own
MODES = ("boundary", "replica_boundary", "every_micro")
EXPECTED = {  # per step: (rounds, calls) inside a replica, then across replicas
    "boundary": ((1, UNITS), (1, UNITS)),
    "replica_boundary": ((K, K * UNITS), (1, UNITS)),
    "every_micro": ((K, K * UNITS), (K, K * UNITS)),
}


def verify(run_dir: Path, *overrides: str) -> Run:
    return run_cli("verify", run_dir, *HSDP, *SMALL, *overrides, timeout=300, env=ENV)


def candidate(run: Run) -> Path:
    """The one candidate's run directory (world 4, micro-batch 2, K=2)."""
    return run.run_dir / "w4-m2-k2"


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=MODES)
def fp64(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Run]:
    """One fp64 verify per mode on the user component: (mode, run)."""
    mode = request.param
    return mode, verify(
        tmp_path_factory.mktemp(mode) / "verify", *USER, "precision=fp64", f"accum.sync={mode}"
    )


def padded_elements(model: torch.nn.Module, shards: int) -> int:
    """Gradient elements one reduce-scatter of every unit takes in: FSDP2 pads each parameter's first dimension
    to a multiple of the shard count."""
    return sum(-(-p.shape[0] // shards) * shards * (p.numel() // p.shape[0]) for p in model.parameters())


def test_every_mode_passes_verify_at_fp64(fp64: tuple[str, Run]) -> None:
    mode, run = fp64
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"fsdp (HSDP, 2 replicas, accum.sync={mode})" in run.stdout
    result = json.loads((run.run_dir / "verify.json").read_text())
    assert result["passed"] and result["tolerance"]["steps"]["rtol"] == 1e-9
    cand = result["candidates"][0]
    assert cand["max_rel_diff"] <= 1e-9 and cand["max_grad_norm_diff"] <= 1e-9


def test_the_ledger_counts_reductions_per_group(
    fp64: tuple[str, Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    import mytask

    mode, run = fp64
    (inner_rounds, inner_calls), (across_rounds, across_calls) = EXPECTED[mode]
    elements = padded_elements(mytask.make_model(), shards=2)
    steps_run = records(candidate(run))
    assert len(steps_run) == 2
    for rec in steps_run:
        assert (rec["comm_rounds"], rec["comm_calls"]) == (inner_rounds, inner_calls), rec
        assert (rec["comm_rounds_replicate"], rec["comm_calls_replicate"]) == (across_rounds, across_calls), (
            rec
        )
        # fp64: 8 bytes per element; a round reduce-scatters every unit, the all-reduce takes each 1/2 shard.
        assert rec["comm_bytes"] == 8 * inner_rounds * elements, rec
        assert rec["comm_bytes_replicate"] == 8 * across_rounds * elements // 2, rec


def test_final_weights_reload_bit_identical_and_the_placement_is_recorded(
    fp64: tuple[str, Run], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    import mytask

    mode, run = fp64
    run_dir = candidate(run)
    summary_ = json.loads((run_dir / "summary.json").read_text())
    assert summary_["sync"] == mode and summary_["replicas"] == 2
    assert summary_["placement"] == {"groups": [[0, 1], [2, 3]], "nodes": [0, 0, 0, 0]}
    model = mytask.make_model().double()
    model.load_state_dict(load_weights(run_dir / "final"))
    total = torch.zeros((), dtype=torch.float64)
    for _, param in model.named_parameters():
        total += param.detach().sum()
    assert float(total) == summary_["param_sum"]


def test_bf16_reduction_passes_verify_at_fp32_with_half_the_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))
    import mytask

    run = verify(
        tmp_path / "verify", *USER, "accum.reduce_dtype=bf16"
    )  # fp32, accum.sync=auto: replica_boundary
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "gradients reduced in bf16: + e = 8 roundings" in run.stdout  # replica_boundary: K x W = 2 x 4
    elements = padded_elements(mytask.make_model(), shards=2)
    for rec in records(candidate(run)):  # 2 bytes per element (fp32: 4) in both groups
        assert rec["comm_bytes"] == 2 * K * elements and rec["comm_bytes_replicate"] == 2 * elements // 2
        assert rec["comm_rounds"] == K and rec["comm_rounds_replicate"] == 1


def test_hugging_face_llama_passes_verify_at_fp32(tmp_path: Path) -> None:
    requires("transformers")
    run = verify(
        tmp_path / "verify",
        "--config-dir",
        str(FIXTURES / "conf"),
        "model=llama",
        "accum.sync=replica_boundary",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((run.run_dir / "verify.json").read_text())
    assert result["passed"] and result["precision"] == "fp32" and result["model"] == "hf_llama.make_llama"
    assert all(r["comm_rounds_replicate"] == 1 for r in records(candidate(run)))


MLP = (
    "engine=fsdp",
    "engine.replicas=2",
    "trainer.nproc=4",
    "precision=fp64",
    "trainer.checkpoint_every=4",
    "trainer.keep_checkpoints=10",
)
N = 24


@pytest.mark.faults
@pytest.mark.timeout(600)
def test_hsdp_checkpoints_restart_a_killed_rank_and_move_to_another_world_size(tmp_path: Path) -> None:
    straight = tmp_path / "straight"
    done = run(straight, *MLP, f"trainer.max_steps={N}")
    assert done.returncode == 0, done.stderr[-3000:]

    killed = tmp_path / "killed"
    proc = start(
        killed, *MLP, f"trainer.max_steps={N}", "trainer.max_restarts=1", "trainer.shutdown_grace_s=5"
    )
    victim = rank_pid(killed, 1)
    wait_for_step(killed, N // 3 + 1, proc)
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-4000:]
    assert "distaccum: resumed from" in out and steps(killed) == list(range(1, N + 1))
    for key in ("param_sum", "param_l2"):
        assert summary(killed)[key] == summary(straight)[key]  # bit for bit

    # The HSDP checkpoint after step 12 (2 replicas x 2 shards) resumed on 2 ranks, flat FSDP (K 2 -> 4).
    moved = tmp_path / "moved"
    shutil.copytree(straight, moved)
    for later in sorted((moved / "checkpoints").glob("step-*")):
        if int(later.name.split("-")[1]) > N // 2:
            shutil.rmtree(later)
    second = run(moved, "engine=fsdp", "trainer.nproc=2", "precision=fp64", f"trainer.max_steps={N}")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {moved}/checkpoints/step-{N // 2:08d}" in second.stdout
    assert steps(moved) == list(range(1, N + 1)) and summary(moved)["accum_steps"] == 4
    assert summary(moved)["replicas"] == 1
    for key in ("param_sum", "param_l2"):
        assert summary(moved)[key] == pytest.approx(summary(straight)[key], rel=1e-12)
