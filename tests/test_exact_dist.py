"""``accum.exact=true`` proved by hash, not tolerance (gloo, CPU): tiny_gpt on variable-length text with dropout,
AdamW, fp32, 20 steps, micro-batch 4, K x W in {8x1, 4x2, 2x4} train parameters with the same SHA-256; the same
sweep without the mode does not (the control, so the test can fail); ``distaccum report`` calls the splits bitwise.
The same bits across a batch ramp that changes K differently on each world, across an elastic resize (2 ranks, one
SIGKILLed in the middle of step 8, resumed on 1 rank from the step-6 checkpoint), and across a loss surge that
outgrows the fixed-point headroom (a redo) on one and on two ranks; FSDP2 (an int64 reduce-scatter) trains DDP's bits
on four ranks and on two ranks resumed on one at step 10. One launch per world size (``conftest.train_plan``) besides
the killed one and the FSDP2 resume, one intra-op thread per rank (CPU kernels' sums depend on it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import distaccum_cli, fault, final_hash, inject, run_cli, train_plan

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

COMMON = (
    "model=tiny_gpt",
    "model.width=32",
    "model.depth=1",
    "model.dropout=0.1",
    "data.dataset.num_samples=256",
    "optim.name=adamw",
    "precision=fp32",
    "trainer.max_steps=20",
    "accum.micro_batch=4",
    "accum.global_batch=32",
    "trainer.check_every=0",
)
SPLITS = {"8x1": 1, "4x2": 2, "2x4": 4}
"""K x W -> the world size (the micro-batch and the global batch fixed: K follows)."""
RAMP = "accum.ramp.points=[[1,16],[6,32]]"
"""Global batch 16 for steps 1-5, then 32: K 4 -> 8 on one rank, 2 -> 4 on two."""
KILL = inject("distaccum.losses.token_cross_entropy", fault("KillRank", rank=1, call=34))
"""Rank 1 of a 2-rank run killed at its 34th micro-batch: 8 in step 1 (measured, then redone), 4 in each step after,
so the 2nd of step 8 (the checkpoint of step 6 the last one). A resume keeps the same loss config (the run identity)."""


def test_every_split_trains_the_same_bits_and_the_control_does_not(tmp_path: Path) -> None:
    runs = {f"control-{name}": (*COMMON, f"trainer.nproc={world}") for name, world in SPLITS.items()}
    runs |= {
        f"exact-{name}": (*COMMON, f"trainer.nproc={world}", "accum.exact=true")
        for name, world in SPLITS.items()
    }
    runs |= {
        f"ramp-{world}": (*COMMON, f"trainer.nproc={world}", "accum.exact=true", RAMP) for world in (1, 2)
    }
    resized = (*COMMON, "accum.exact=true", "trainer.checkpoint_every=3", *KILL)
    killed = run_cli("train", tmp_path / "resized", *resized, "trainer.nproc=2")
    logged = [
        json.loads(line)["step"] for line in (tmp_path / "resized" / "metrics.jsonl").read_text().splitlines()
    ]
    checkpoints = sorted(p.name for p in (tmp_path / "resized" / "checkpoints").glob("step-*"))
    runs["resized"] = (
        *resized,
        "trainer.nproc=1",
    )  # resumed on 1 rank (before the surge's fault is installed)
    unclipped = (*COMMON, "accum.exact=true", "optim.clip_norm=null")  # FSDP2's sharded norm is refused
    runs["fsdp-4"] = (*unclipped, "engine=fsdp", "trainer.nproc=4")
    halfway = "trainer.max_samples=320"  # steps 1-10; the lr horizon stays 20
    runs["fsdp-moved"] = (*unclipped, "engine=fsdp", "trainer.nproc=2", halfway)
    runs["ddp-unclipped"] = (*unclipped, "trainer.nproc=1")
    surge = inject(
        "distaccum.losses.token_cross_entropy", fault("LossSurge", step=5)
    )  # 4096x: beyond the headroom
    runs |= {
        f"surge-{world}": (*COMMON, f"trainer.nproc={world}", "accum.exact=true", *surge) for world in (1, 2)
    }
    done = train_plan(tmp_path, runs)
    halfway_steps = done["fsdp-moved"].summary["steps"]
    moved = train_plan(tmp_path, {"fsdp-moved": (*unclipped, "engine=fsdp", "trainer.nproc=1")})["fsdp-moved"]
    exact = {name: done[f"exact-{name}"].summary for name in SPLITS}
    hashes = {name: summary["params_sha256"] for name, summary in exact.items()}
    assert len(set(hashes.values())) == 1, hashes
    files = {name: final_hash(done[f"exact-{name}"].run_dir) for name in SPLITS}
    assert len(set(files.values())) == 1, files  # final/ holds those bits too
    for name, summary in exact.items():
        assert summary["steps"] == 20 and summary["exact"]["redos"] == 1, (
            name,
            summary,
        )  # the first step measures
    assert killed.returncode != 0 and logged == list(range(1, 8)), (killed.returncode, logged)
    assert checkpoints[-1] == "step-00000006", checkpoints  # 7 steps done, the 8th killed mid-window
    # Steps 1-6 from the killed run (K 4 on 2 ranks), 7-20 resumed on 1 rank (K 8): a resume, not a fresh start (whose
    # hash an exact run would reproduce too).
    assert [r["micro_steps"] for r in done["resized"].records] == [4] * 6 + [8] * 14
    resized = done["resized"].summary
    assert resized["steps"] == 20 and resized["params_sha256"] == hashes["8x1"], resized  # resumed on 1 rank
    surged = [
        done[f"surge-{world}"].summary for world in (1, 2)
    ]  # last in their launches: the fault stays installed
    assert surged[0]["params_sha256"] == surged[1]["params_sha256"] != hashes["8x1"], surged
    assert surged[0]["exact"]["redos"] == surged[1]["exact"]["redos"] == 2, surged  # step 1 and step 5
    assert halfway_steps == 10 and moved.summary["steps"] == 20, moved.summary
    assert [r["micro_steps"] for r in moved.records] == [4] * 10 + [8] * 10  # resumed on 1 rank at step 11
    sharded = [done[name].summary["params_sha256"] for name in ("fsdp-4", "ddp-unclipped")]
    sharded.append(moved.summary["params_sha256"])  # FSDP2 on 2 ranks to step 10, on 1 rank from there
    assert sharded[0] == sharded[1] == sharded[2] != hashes["8x1"], (
        sharded
    )  # FSDP2 (int64 reduce-scatter) = DDP
    ramps = [done[f"ramp-{world}"].summary["params_sha256"] for world in (1, 2)]
    assert ramps[0] == ramps[1] != hashes["8x1"], ramps
    shown = distaccum_cli(["report", *(str(done[f"exact-{name}"].run_dir) for name in SPLITS)], cwd=tmp_path)
    assert shown.returncode == 0 and shown.stdout.count(f"bitwise (sha256 {hashes['8x1'][:12]})") == 2, (
        shown.stdout
    )
    control = {name: final_hash(done[f"control-{name}"].run_dir) for name in SPLITS}
    assert len(set(control.values())) == len(SPLITS), control  # float sums: every split its own bits
    assert not set(control.values()) & set(files.values()), (control, files)


def test_verify_compares_an_exact_run_with_its_reference_bit_for_bit(tmp_path: Path) -> None:
    """The candidate (4x2) against verify's one-process exact reference (8x1): equal SHA-256, reported bitwise."""
    run_dir = tmp_path / "verify"
    common = [c for c in COMMON if not c.startswith(("trainer.max_steps", "trainer.check_every"))]
    done = run_cli("verify", run_dir, *common, "trainer.max_steps=5", "accum.exact=true", "trainer.nproc=2")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compared bit for bit" in done.stdout and "BITWISE" in done.stdout, done.stdout
    (row,) = json.loads((run_dir / "verify.json").read_text())["candidates"]
    assert row["passed"] and row["bitwise"] and row["max_abs_diff"] == 0.0, row
