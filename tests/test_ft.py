"""Fault-tolerant replica groups (ft.groups, torchft): a lost group costs no sample and no restart.

One real run of three groups of one gloo rank each, with torchft's real Lighthouse (started by ``distaccum train``)
and Managers: group 1 is SIGKILLed in the middle of step 3's micro-batches, group 2 as it enters the reduction across
groups of step 16; the launcher restarts each and it heals from a live group. The final parameters of every group
must equal an uninterrupted single-process run of the same global batch within the fp64 bound below, every step's
record must show the global batch, and the sample ids the groups trained at each step must be that step's window,
each once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import fault, final_hash, inject, requires, run_cli

pytestmark = [pytest.mark.dist, pytest.mark.faults]
# torchft's Rust logger reads RUST_LOG once, when torchft is imported (a launch sets it first, as here)
os.environ.setdefault("RUST_LOG", "warn")
requires("torchft")

STEPS, G, MICRO, LR = 36, 24, 2, 0.05
COMMON = [
    "model=mlp",
    "precision=fp64",
    f"accum.global_batch={G}",
    f"accum.micro_batch={MICRO}",
    f"trainer.max_steps={STEPS}",
    "optim.name=sgd",
    "optim.momentum=0.0",
    f"optim.lr={LR}",
    "optim.schedule=constant",
    "optim.warmup_steps=0",
    "trainer.save_final=true",
]
TIMEOUT_S = 2.0
FT = [
    "ft.min_groups=1",
    "ft.heartbeat_timeout_ms=300",
    f"ft.timeout_s={TIMEOUT_S}",
    "ft.restarts=1",
    "ft.sample_ids=true",
]
U = 2.0**-53  # fp64 unit roundoff


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def order_bound(ref: list[dict]) -> float:
    """How far two runs that sum the same P = G/micro piece gradients per step in different orders may end apart.

    Step s's reduced gradient is a sum of P fp64 pieces; any two summation orders differ elementwise by at most
    2 (P - 1) u sum_k |g_k| (Higham, 4.3). With plain SGD (no momentum) the parameters' difference after T steps is
    the sum over steps of lr times that, divided by N, to first order (the gradient's own dependence on the
    parameters multiplies it by (1 + lr L) per step: a factor below 2 here, taken as 2). sum_k |g_k| / N is bounded
    by P times the largest piece's share, which we take as the reduced gradient's norm (grad_norm): the pieces of a
    regression MLP's window are of one size. So the bound is 2 sum_s lr 2 (P - 1) u P grad_norm_s."""
    pieces = G // MICRO
    return 2 * sum(LR * 2 * (pieces - 1) * U * pieces * float(r["grad_norm"]) for r in ref)


def wake_stopped(groups: Path, done: threading.Event, after_s: float = 1.0) -> None:
    """SIGCONT the first rank found stopped (state T) under ``groups``' rank files, ``after_s`` after seeing it."""
    while not done.is_set():
        for info in groups.glob("*/ranks/*.json"):
            try:
                pid = int(json.loads(info.read_text())["pid"])
                with open(f"/proc/{pid}/stat") as stat:
                    state = stat.read().rsplit(")", 1)[1].split()[0]
            except (OSError, ValueError, KeyError):
                continue
            if state == "T":
                time.sleep(after_s)
                os.kill(pid, signal.SIGCONT)
                return
        time.sleep(0.1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted single-process run of the same global batch (both tests compare with it)."""
    run_dir = tmp_path_factory.mktemp("ft") / "ref"
    ref = run_cli("train", run_dir, *COMMON, "trainer.nproc=1", timeout=120)
    assert ref.returncode == 0, ref.stderr[-2000:]
    return run_dir


def final_gap(run_dir: Path, want: dict[str, torch.Tensor]) -> float:
    got = load_file(str(run_dir / "final" / "model.safetensors"))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def test_lost_groups_cost_no_sample_and_no_restart(tmp_path: Path, reference: Path) -> None:
    faults = inject(
        "distaccum.losses.mse",
        # step 3, its 2nd micro-batch of 4; restarted, it rejoins a second later (the others go on with K = 6)
        fault("KillGroup", group=1, call=2 * (G // MICRO // 3) + 2, rejoin_s=1.0),
        fault("KillGroup", group=2, step=16),  # as it enters step 16's reduction across groups
        # hung in step 21's reduction, woken after the timeout
        fault("KillGroup", group=0, step=21, signal="SIGSTOP"),
        # steps of ~0.1 s: each restart (~0.5 s) and rejoin fall between steps
        fault("SlowLoss", seconds=0.02),
    )
    done = threading.Event()
    waker = threading.Thread(
        target=wake_stopped, args=(tmp_path / "ft" / "groups", done, TIMEOUT_S + 1.0), daemon=True
    )
    waker.start()
    try:
        run = run_cli(
            "train",
            tmp_path / "ft",
            *COMMON,
            "trainer.nproc=1",
            "ft.groups=3",
            *FT,
            *faults,
            timeout=180,
            env={"RUST_LOG": "warn"},
        )
    finally:
        done.set()
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    assert run.stdout.count("restarting it") == 2, run.stdout[-3000:]
    groups = sorted((tmp_path / "ft" / "groups").iterdir())
    assert [g.name for g in groups] == ["g0-a0", "g1-a0", "g1-a1", "g2-a0", "g2-a1"]

    # Every committed step: the global batch, and the window's samples trained once across the groups present.
    by_step: dict[int, list[dict]] = {}
    for g in groups:
        for r in records(g):
            by_step.setdefault(int(r["step"]), []).append(r)
    assert sorted(by_step) == list(range(1, STEPS + 1))  # steps lost: 0
    windows = {int(r["step"]): r for r in records(reference)}
    missing_at, attempts, epoch, sat_out = set(), {}, [], []
    for step, rs in by_step.items():
        present = rs[0]["ft_groups"]
        assert all(r["ft_groups"] == present for r in rs)
        # A group that healed in the step's quorum sits it out: no pieces, its gradient zeros in the sum.
        healers = [r for r in rs if r["ft_group"] not in present]
        assert all(r["ft_healed"] and r["ft_sample_ids"] == [] and r["micro_steps"] == 0 for r in healers), rs
        sat_out += [(step, r["ft_group"]) for r in healers]
        assert {r["ft_group"] for r in rs} - {r["ft_group"] for r in healers} == set(present), (step, rs)
        samples = windows[step]["samples"]  # G, but the epoch's last window (partial: what is left of it)
        assert all(r["global_batch"] == G and r["samples"] == samples for r in rs)
        assert all(r["micro_steps"] == G // (MICRO * len(present)) for r in rs if r not in healers)
        ids = [i for r in rs for i in r["ft_sample_ids"]]
        assert len(ids) == samples and len(set(ids)) == samples, (step, sorted(ids))
        if windows[step]["epoch"] == 0:
            epoch += ids
        assert rs[0]["loss"] == pytest.approx(windows[step]["loss"], rel=1e-9)
        if len(present) < 3:
            missing_at.add(step)
        attempts[step] = max(r["ft_attempts"] for r in rs)
    assert len(epoch) == len(set(epoch)) == sum(r["samples"] for r in windows.values() if r["epoch"] == 0)
    # Bytes across groups, per rank and step: the healed-flags sum (one float64 per group), then the one collective
    # of the gradients (float64) and the window's row (5 totals and one flag per group).
    params = sum(t.numel() for t in load_file(str(reference / "final" / "model.safetensors")).values())
    clean = [r for rs in by_step.values() for r in rs if r["ft_attempts"] == 1]
    assert clean and all(r["ft_bytes"] == 8 * 3 + 8 * (params + 5 + 3) for r in clean), clean[0]["ft_bytes"]
    assert all(
        r["ft_bytes"] > 8 * (params + 8) for rs in by_step.values() for r in rs if r["ft_attempts"] > 1
    )
    assert 3 in missing_at  # step 3 computed again by the two groups left, K 4 -> 6
    assert attempts[3] >= 2 and attempts[16] >= 2, (
        attempts
    )  # each failed step computed again (committed once)
    assert any(r.get("ft_healed") for g in groups if g.name.endswith("a1") for r in records(g))
    assert {group for _, group in sat_out} == {0, 1, 2}, (
        sat_out
    )  # each healing group sat its healing step out
    # The hung group left the run within ft.timeout_s (the others' step 21 went on without it); woken, it healed.
    assert 0 not in by_step[21][0]["ft_groups"]
    assert max(r["time_s"] for r in by_step[21]) < TIMEOUT_S + 2.0
    assert any(r["ft_healed"] for r in records(tmp_path / "ft" / "groups" / "g0-a0") if r["step"] > 21)

    # Final parameters: every group's against the uninterrupted run, within the summation-order bound.
    bound = order_bound(records(reference))
    want = load_file(str(reference / "final" / "model.safetensors"))
    finals = [g for g in groups if (g / "final" / "model.safetensors").exists()]
    assert {g.name[:2] for g in finals} == {"g0", "g1", "g2"}
    for g in finals:
        got = load_file(str(g / "final" / "model.safetensors"))
        gap = max(float((got[k] - want[k]).abs().max()) for k in want)
        assert gap <= bound, (g.name, gap, bound)
        assert all(
            torch.equal(got[k], load_file(str(finals[0] / "final" / "model.safetensors"))[k]) for k in got
        )
    print(f"ft: final parameters within {bound:.3g} of the uninterrupted run (measured gap {gap:.3g})")


def test_fsdp2_groups_heal_a_sharded_state(tmp_path: Path, reference: Path) -> None:
    """Two groups of two FSDP2 ranks: group 1 SIGKILLed in step 3's micro-batches, restarted, heals shard by shard
    from group 0 (each rank from its peer); both groups end equal, and equal to the uninterrupted run within the
    bound."""
    faults = inject(
        "distaccum.losses.mse",
        fault("KillGroup", group=1, call=2 * (G // MICRO // 4) + 2),  # step 3: K = 3 per rank, its 2nd
        fault("SlowLoss", seconds=0.02),
    )
    fsdp = ["engine=fsdp", "trainer.fingerprint=false", "trainer.nproc=2", "ft.groups=2"]
    overrides = [*COMMON, *FT, *fsdp, *faults]
    run = run_cli("train", tmp_path / "ft", *overrides, timeout=180, env={"RUST_LOG": "warn"})
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    groups = tmp_path / "ft" / "groups"
    assert sorted(g.name for g in groups.iterdir()) == ["g0-a0", "g1-a0", "g1-a1"]
    healed = [r for r in records(groups / "g1-a1") if r["ft_healed"]]
    assert healed and [r["step"] for r in records(groups / "g0-a0")] == list(range(1, STEPS + 1))
    want = load_file(str(reference / "final" / "model.safetensors"))
    assert final_gap(groups / "g0-a0", want) <= order_bound(records(reference))
    assert (
        final_gap(groups / "g1-a1", load_file(str(groups / "g0-a0" / "final" / "model.safetensors"))) == 0.0
    )


EXACT = [
    "model=tiny_gpt",
    "model.width=32",
    "model.depth=1",
    "model.dropout=0.1",
    "data.dataset.num_samples=768",
    "optim.name=adamw",
    "optim.clip_norm=null",  # FSDP2's norm is a float sum over its shards: refused by exact mode
    "precision=fp32",
    "accum.micro_batch=4",
    "accum.global_batch=48",
    "trainer.max_steps=16",
    "trainer.check_every=0",
    "trainer.save_final=true",
    "accum.exact=true",
]
"""Exact accumulation on variable-length text with dropout, AdamW, fp32: 16 windows of 48 samples in 12 pieces of 4
(K = 12 / (ranks per group x groups present): 4, 6 or 12 with three groups of one rank, 3 or 6 with two of two)."""
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
"""One intra-op thread in every rank (a CPU kernel's sums depend on the thread count: outside the exact guarantee)."""


@pytest.fixture(scope="module")
def exact_one(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SHA-256 of one process taking each whole window (K = 12) in exact mode."""
    run_dir = tmp_path_factory.mktemp("ft") / "exact-one"
    one = run_cli("train", run_dir, *EXACT, "trainer.nproc=1", timeout=120, env=ONE_THREAD)
    assert one.returncode == 0, one.stderr[-2000:]
    return final_hash(run_dir)


def exact_groups(
    run_dir: Path, *overrides: str, faults: list[str]
) -> tuple[dict[int, list[dict]], dict[str, str]]:
    """Run exact-mode replica groups: every step's records, and each group attempt's final SHA-256."""
    run = run_cli(
        "train",
        run_dir,
        *EXACT,
        *FT,
        *overrides,
        *faults,
        timeout=180,
        env={**ONE_THREAD, "RUST_LOG": "warn"},
    )
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    groups = sorted((run_dir / "groups").iterdir())
    by_step: dict[int, list[dict]] = {}
    for g in groups:
        for r in records(g):
            by_step.setdefault(int(r["step"]), []).append(r)
    assert sorted(by_step) == list(range(1, 17))  # steps lost: 0
    return by_step, {g.name: final_hash(g) for g in groups if (g / "final").exists()}


def test_exact_groups_train_the_bits_of_one_process_through_failures(tmp_path: Path, exact_one: str) -> None:
    """``accum.exact`` across replica groups: the int64 sum crosses the groups before the commit vote, a step that
    does not count puts the scale back, a redo (the first step's measuring pass) stays in its quorum, and the pieces
    keep their index and dropout seed whichever group computes them. Three groups of one rank, group 1 SIGKILLed in
    step 3's micro-batches and group 2 as it enters step 6's reduction, each restarted and healed: every group's
    final parameters have the SHA-256 of one process taking the whole window. Group 0 waits for each restarted
    group to ask for its first quorum (at its 24th and 44th micro-batch: after the kill, at the latest in steps 5
    and 10), so both heal before the end however slowly they restart."""
    faults = inject(
        "distaccum.losses.token_cross_entropy",
        # step 1 runs its window twice (the scale's measuring pass, then the sum): K = 4 per group, so the 14th call
        # is step 3's 2nd micro-batch
        fault("KillGroup", group=1, call=14),
        fault("KillGroup", group=2, step=6),
        fault("AwaitRejoin", waiting=0, restarted=1, call=24, marker=str(tmp_path / "g1-rejoined")),
        fault("AwaitRejoin", waiting=0, restarted=2, call=44, marker=str(tmp_path / "g2-rejoined")),
    )
    by_step, got = exact_groups(tmp_path / "ft", "trainer.nproc=1", "ft.groups=3", faults=faults)
    assert sorted(got) == ["g0-a0", "g1-a1", "g2-a1"]  # the killed attempts saved nothing
    assert max(r["ft_attempts"] for r in by_step[3]) >= 2 and max(r["ft_attempts"] for r in by_step[6]) >= 2
    assert {len(rs[0]["ft_groups"]) for rs in by_step.values()} >= {2, 3}  # K grew while a group was away
    healed = {r["ft_group"] for rs in by_step.values() for r in rs if r["ft_healed"]}
    assert healed == {1, 2}, healed
    assert set(got.values()) == {exact_one}, (got, exact_one)
    print(f"ft exact: every group ends on one process's parameters, sha256 {exact_one[:16]}")


def test_exact_fsdp2_groups_heal_shards_to_the_same_bits(tmp_path: Path, exact_one: str) -> None:
    """Two groups of two FSDP2 ranks in exact mode (an int64 reduce-scatter inside the group, its shards summed across
    groups): group 1 SIGKILLed in step 2's micro-batches, restarted, heals shard by shard with the scale: both end on
    one process's SHA-256."""
    faults = inject(
        "distaccum.losses.token_cross_entropy",
        # K = 3 per rank: 6 calls in step 1 (measured, then summed), so the 8th is step 2's 2nd micro-batch
        fault("KillGroup", group=1, call=8),
        # group 0 held at its 20th (at the latest in step 6) until the restarted group asks for its first quorum
        fault("AwaitRejoin", waiting=0, restarted=1, call=20, marker=str(tmp_path / "rejoined")),
    )
    fsdp = ["engine=fsdp", "trainer.nproc=2", "ft.groups=2"]  # exact mode takes no reduction checksum
    by_step, got = exact_groups(tmp_path / "ft", *fsdp, faults=faults)
    assert sorted(got) == ["g0-a0", "g1-a1"]
    assert max(r["ft_attempts"] for r in by_step[2]) >= 2  # the killed step computed again by group 0 alone
    assert any(r["ft_healed"] for rs in by_step.values() for r in rs if r["ft_group"] == 1)
    assert set(got.values()) == {exact_one}, (got, exact_one)
