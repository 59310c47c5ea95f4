"""The sharded engines' reduction checksum (distaccum/engines/checksum.py, checked by the reduction fingerprint).

- unit: the invariant on shards simulated in one process: the local sums of W ranks equal the reduced shards' sums
  after a correct reduction (fp32 accumulation and reduction, bf16 gradients accumulated in fp32: no false positive
  over many random draws at the stated tolerance) and are far outside it after a skipped, doubled or mis-scaled one;
  the sample is the same on every rank and covers every tensor;
- dist: real 2-rank runs on FSDP2 and DeepSpeed ZeRO 0, 1, 2 and 3 (and a 4-rank HSDP run): a correct run of several
  steps, fp32 and bf16, is never flagged; a reduction skipped, doubled or scaled from step s on
  (:class:`distaccum.testing.reduction.CorruptReduction`, on the real collectives the engine runs) stops the run
  with ``divergence.json`` naming step s and the ratio. These runs also fail loudly if torch or DeepSpeed move the
  internals the engines read (FSDP2's stable unsharded parameters and dim-0 chunks; ZeRO's partition addresses):
  the local or the reduced side would then be missing and a correct run would be flagged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import EXTENSIONS, Run, inject, run_cli
from distaccum.engines.checksum import ReductionChecksum, agree, sample_positions, tolerance

W, K = 2, 3
SHAPES = [(37, 5), (11,), (8, 3, 2), (1,)]


def shards_of(numel: int, rows: int, world: int) -> list[tuple[int, int]]:
    """FSDP2's dim-0 ``torch.chunk`` pieces of a tensor of ``rows`` rows, as flat ranges."""
    per_row, chunk = numel // rows, -(-rows // world)
    return [(min(r * chunk, rows) * per_row, min((r + 1) * chunk, rows) * per_row) for r in range(world)]


def simulate(
    grad_dtype: torch.dtype, seed: int, corrupt: str | None = None
) -> tuple[list[list[float]], float]:
    """W ranks' [a, m, b] for K micro-batches of random gradients of ``grad_dtype``, accumulated and summed over the
    ranks in fp32 as the engines do (an fp32 reduce-scatter), the reduction ``corrupt``-ed or not."""
    gen = torch.Generator().manual_seed(seed)
    numels = [int(torch.Size(s).numel()) for s in SHAPES]
    ranges = [shards_of(n, s[0], W) for n, s in zip(numels, SHAPES, strict=True)]
    checks, leaves, local = [], [], []
    for r in range(W):
        check = ReductionChecksum(numels, [rg[r] for rg in ranges], K, torch.device("cpu"), grad_dtype)
        mine = [torch.zeros(s, requires_grad=True) for s in SHAPES]
        check.watch(mine)
        accumulated = [torch.zeros(s) for s in SHAPES]
        for k in range(K):
            check.micro = k
            grads = [(torch.randn(s, generator=gen) * 10.0 ** (k - 1)).to(grad_dtype) for s in SHAPES]
            torch.autograd.backward(
                [(leaf.to(grad_dtype) * g).sum() for leaf, g in zip(mine, grads, strict=True)]
            )
            for acc, g in zip(accumulated, grads, strict=True):
                acc += g.float()  # fp32 accumulation of what autograd delivered
        checks.append(check)
        leaves.append(mine)
        local.append(accumulated)
    reduced = [sum(local[r][j] for r in range(W)).reshape(-1) for j in range(len(SHAPES))]  # fp32 SUM
    rows = []
    for r, check in enumerate(checks):
        shards = []
        for j in range(len(SHAPES)):
            lo, hi = ranges[j][r]
            piece = reduced[j][lo:hi]
            if corrupt == "skip":
                piece = local[r][j].reshape(-1)[lo:hi]
            elif corrupt == "double":
                piece = piece * 2
            elif corrupt == "mean":
                piece = piece / W
            shards.append(piece)
        rows.append(check.take(shards).tolist())
    return rows, tolerance(K, W, [torch.float32])


@pytest.mark.unit
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_correct_reduction_always_agrees_within_the_rounding_bound(grad_dtype: torch.dtype) -> None:
    """fp32 gradients, and bf16 ones accumulated and reduced in fp32 (FSDP2's bf16 with fsdp_reduce_fp32): the
    checksum reads the bf16 values as delivered, so fp32's bound (K + W + 2) 2^-24 holds; micro-batches of very
    different magnitudes (10^-1 .. 10^1) make the accumulation round."""
    for seed in range(40):
        rows, tol = simulate(grad_dtype, seed)
        ok, ratios = agree(rows, [list(range(W))], tol)
        assert ok, (seed, rows, ratios)


@pytest.mark.unit
@pytest.mark.parametrize(("corrupt", "ratio"), [("skip", None), ("double", 2.0), ("mean", 1 / W)])
def test_a_skipped_doubled_or_scaled_reduction_leaves_the_bound_by_far(
    corrupt: str, ratio: float | None
) -> None:
    for seed in range(10):
        rows, tol = simulate(torch.float32, seed, corrupt)
        ok, ratios = agree(rows, [list(range(W))], tol)
        a, m = sum(r[0] for r in rows), sum(r[1] for r in rows)
        assert not ok and abs(sum(r[2] for r in rows) - a) > 100 * tol * m, (seed, rows)
        if ratio is not None:
            assert ratios[0] == pytest.approx(ratio, rel=1e-5)


@pytest.mark.unit
def test_replicas_are_checked_each_on_its_own() -> None:
    """HSDP: every replica holds all of G; one replica's reduced sums wrong fails even when the total looks right."""
    good = [[1.0, 2.0, 0.5], [0.5, 2.0, 0.5]]  # a = 1.5; a replica of two ranks holds 0.5 + 0.5 ... of G
    assert not agree([*good, [0.0, 0.0, 1.0], [0.0, 0.0, 0.5]], [[0, 1], [2, 3]], 1e-6)[0]
    assert agree(
        [[1.0, 2.0, 1.0], [0.5, 2.0, 0.5], [0.0, 0.0, 1.0], [0.0, 0.0, 0.5]], [[0, 1], [2, 3]], 1e-6
    )[0]
    # A non-finite gradient is not judged here (the non-finite policy's).
    assert agree([[float("nan"), 1.0, 0.0], [0.0, 0.0, 0.0]], [[0, 1]], 1e-6)[0]


@pytest.mark.unit
def test_the_sample_is_the_same_everywhere_and_covers_every_tensor() -> None:
    numels = [10_000_000, 3, 1, 4096]
    first, again = sample_positions(numels), sample_positions(numels)
    for (p, w), (q, v) in zip(first, again, strict=True):
        assert torch.equal(p, q) and torch.equal(w, v)
    assert all(
        p[0] == 0 and len(p) >= 1 and int(p.max()) < n for (p, _), n in zip(first, numels, strict=True)
    )
    assert 4000 <= sum(len(p) for p, _ in first) <= 4200
    assert all(bool(((w >= 1) & (w < 2)).all()) for _, w in first)
    assert tolerance(4, 2, [torch.float32]) == 8 * 2.0**-24
    assert tolerance(4, 2, [torch.float32, torch.bfloat16]) == 8 * 2.0**-8


def corrupt(mode: str, from_step: int, factor: float = 1.0) -> str:
    return f"{{_target_:distaccum.testing.reduction.CorruptReduction,mode:{mode},factor:{factor},from_step:{from_step}}}"


BASE = ("model=mlp", "accum.micro_batch=2", "accum.steps=4", "trainer.nproc=2", "optim.schedule=constant")
DS = ("engine=deepspeed", f"engine.extensions_dir={EXTENSIONS}")  # DeepSpeed's op compiled once per machine
ENGINES = {
    "fsdp": ("engine=fsdp",),
    "zero0": (*DS, "engine.zero_stage=0"),
    "zero1": (*DS, "engine.zero_stage=1"),
    "zero2": (*DS, "engine.zero_stage=2"),
    "zero3": (*DS, "engine.zero_stage=3"),
}
CASES = [  # engine, fault, from step, expected ratio (None: only "not 1"); every engine's own code path once
    ("fsdp", "{_target_:distaccum.testing.reduction.SkippedBoundarySync}", 1, 0.0),
    ("fsdp", corrupt("scale", 3, 2.0), 3, 2.0),
    ("zero0", corrupt("skip", 2), 2, None),
    ("zero1", corrupt("scale", 2, 2.0), 2, 2.0),
    ("zero2", corrupt("scale", 1, 0.5), 1, 0.5),
    ("zero3", corrupt("skip", 2), 2, None),
]


def train(
    tmp_path: Path, name: str, engine: str, *extra: str, fault: str | None = None, steps: int = 6
) -> Run:
    faults = inject("distaccum.losses.mse", fault) if fault else ()
    return run_cli(
        "train",
        tmp_path / name,
        *BASE,
        *ENGINES[engine],
        f"trainer.max_steps={steps}",
        *faults,
        *extra,
        timeout=240,
    )


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("engine", "fault", "step", "ratio"), CASES)
def test_a_bad_reduction_stops_the_run_naming_its_step(
    tmp_path: Path, engine: str, fault: str, step: int, ratio: float | None
) -> None:
    run = train(tmp_path, "bad", engine, fault=fault)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((run.run_dir / "divergence.json").read_text())
    assert (report["check"], report["step"], report["parameter"]) == (
        "fingerprint",
        step,
        "(reduction checksum)",
    )
    if ratio is not None:
        assert report["ratio"] == pytest.approx(ratio, rel=1e-4)
    else:
        assert abs(report["ratio"] - 1.0) > 0.05
    assert f"the gradient reduction went wrong at optimizer step {step}" in run.stderr
    assert max((r["step"] for r in run.records), default=0) <= step  # stopped before step + 1's record


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_correct_bf16_run_is_never_flagged(tmp_path: Path) -> None:
    """bf16 gradients (the loosest bound). Correct fp32 runs of every engine, boundary and every_micro, run with the
    check on in tests/test_engines.py (and the bug zoo's controls): a false positive there fails the run (exit 1)."""
    run = train(tmp_path, "ok", "fsdp", "precision=bf16", steps=8)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert not (run.run_dir / "divergence.json").exists()
    assert len(run.records) == 8


HSDP = (
    "engine=fsdp",
    "engine.replicas=2",
    "trainer.nproc=4",
    "model=mlp",
    "accum.micro_batch=1",
    "accum.steps=2",
)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_hsdp_checks_each_replica(tmp_path: Path) -> None:
    """2 replicas x 2 shards (replica_boundary): a correct run of 4 steps passes; the cross-replica all-reduce and
    the in-replica reduce-scatter kept local from step 2 on stops at step 2."""
    ok = run_cli("train", tmp_path / "ok", *HSDP, "trainer.max_steps=4", timeout=240)
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-3000:]
    assert not (ok.run_dir / "divergence.json").exists()
    bad = run_cli(
        "train",
        tmp_path / "bad",
        *HSDP,
        "trainer.max_steps=4",
        *inject("distaccum.losses.mse", corrupt("skip", 2)),
    )
    assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-3000:]
    report = json.loads((bad.run_dir / "divergence.json").read_text())
    assert (report["step"], report["parameter"]) == (2, "(reduction checksum)")
    assert report["ranks"] in ([0, 1], [2, 3])


@pytest.mark.unit
def test_fsdp2_still_keeps_the_unsharded_parameters_the_hooks_watch() -> None:
    """The FSDP2 internals the engine relies on, in one process (a one-rank group): ``unshard()`` registers the
    unsharded parameters, which stay the same objects from step to step, so hooks registered once at ``wrap`` see
    every micro-batch's gradient (a = b, m > 0 at every step; a frozen parameter takes no hook). If torch made new
    unsharded parameters, a would be 0 and this fails."""
    from conftest import engine_spec, one_rank_group
    from distaccum.config import EngineConfig
    from distaccum.engines.fsdp import FSDPEngine
    from distaccum.models import MLP
    from distaccum.split import Split
    from distaccum.telemetry.ledger import CommLedger

    torch.manual_seed(0)
    with one_rank_group("cpu"):
        spec = engine_spec(EngineConfig(name="fsdp"), Split(2, 2, 1), sample_grads=True)
        engine = FSDPEngine(spec, CommLedger())
        net = MLP(in_dim=6, width=8, depth=2, out_dim=3)
        net.net[0].bias.requires_grad_(False)  # type: ignore[index,union-attr]
        model = engine.wrap(net, lambda params: torch.optim.SGD(params, lr=0.1))
        try:
            for _ in range(3):
                for k in range(2):
                    with engine.sync(k == 1):
                        engine.backward(model(torch.randn(2, 6)).square().sum())
                sums = engine.step(None, 1.0).grad_sums
                assert sums is not None
                a, m, b = sums.tolist()
                assert m > 0 and abs(a - b) <= engine.checksum.tolerance * m, (a, m, b)
        finally:
            engine.teardown()
