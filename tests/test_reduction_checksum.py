"""The sharded engines' reduction checksum (distaccum/guards/checksum.py, checked by the reduction fingerprint).

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

import collections
import json
from pathlib import Path

import pytest
import torch

from benchmarks.checksum_margin import simulate
from conftest import EXTENSIONS, REPO, Run, inject, run_cli
from distaccum.guards.checksum import Rounding, agree, sample_positions, verdict


@pytest.mark.unit
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_correct_reduction_never_leaves_the_bound_and_a_wrong_one_does(dtype: torch.dtype) -> None:
    """Simulated ranks (benchmarks/checksum_margin.py: the engine's accumulation and a rounded W-term sum in the
    dtype, judged by the checksum's own functions) at the sweep's extremes of K: a correct reduction's worst sampled
    element stays within its bound (W = 2 and 16), a doubled, halved or skipped one leaves it (W = 2; bf16 at
    W = 64 on uncorrelated ranks is what docs/verification.md shows the check cannot promise)."""
    for k in (1, 64):
        for seed in range(2):
            assert simulate(k, 2, dtype, None, seed, n=512) <= 1.0
            assert simulate(k, 16, dtype, None, seed, n=512) <= 1.0
            for fault in ("double", "halve", "skip"):
                assert simulate(k, 2, dtype, fault, seed, n=512) > 1.0, (k, seed, fault)


@pytest.mark.unit
def test_the_bound_no_longer_grows_with_k_where_the_accumulation_is_reproduced() -> None:
    """(W - 1) u for the one reduction after an exact local side; the K-term only where each micro-batch is reduced
    on its own (and the run says so at start)."""
    one = Rounding(
        world=2, accum_steps=64, reduce=torch.bfloat16, held=torch.float32, accumulate=torch.bfloat16
    )
    assert one.coefficient() == pytest.approx(2.0**-8, rel=0.02) and not one.k_term
    each = Rounding(world=2, accum_steps=64, reduce=torch.bfloat16, held=torch.bfloat16, accumulate=None)
    assert each.k_term and each.coefficient() > 64 * 2.0**-8
    assert "agrees over the micro-batches" in each.describe()


@pytest.mark.unit
def test_where_the_sweep_misses_a_fault_the_run_says_at_start_that_it_is_not_checked() -> None:
    """bf16 over 64 ranks of uncorrelated gradients: the simulated doubled/halved/skipped reduction stays inside the
    bound (share <= 1, docs/verification.md's table), so that combination must be announced as not checked; every
    combination the simulation misses is announced; fp32 and fp16 up to W = 64 are not (nothing to announce)."""
    for dtype in (torch.bfloat16, torch.float16):
        for w in (8, 64):
            rounding = Rounding(world=w, accum_steps=1, reduce=dtype, held=dtype, accumulate=dtype)
            missed = min(simulate(1, w, dtype, f, 0, n=1024) for f in ("double", "halve", "skip")) <= 1.0
            assert not missed or (rounding.announced and "NOT CHECKED" in rounding.describe()), (dtype, w)
            assert missed == (dtype == torch.bfloat16 and w == 64), (dtype, w)  # the table's one "NO" row

    def made(w: int, dtype: torch.dtype, held: torch.dtype | None = None) -> Rounding:
        return Rounding(world=w, accum_steps=16, reduce=dtype, held=held or dtype, accumulate=dtype)

    assert all(made(w, d).checks_uncorrelated for d in (torch.float32, torch.float16) for w in (2, 23, 64))
    bf16 = [made(w, torch.bfloat16, torch.float32) for w in (2, 22, 23)]
    assert not bf16[0].announced  # W = 2 (the dist tests' runs): checked, nothing said
    assert [r.checks_uncorrelated for r in bf16] == [True, True, False]  # bf16 from W = 23 on (the docstring)


@pytest.mark.unit
def test_the_docs_carry_the_checksum_host_cost_as_stored() -> None:
    """docs/verification.md's bench:checksum_host_ops section is the render of docs/results/checksum-ops.json (FSDP2
    and ZeRO-2 on the host-ops harness) beside the stored DDP count, and the checksum adds no collective per
    micro-batch: its only per-micro-batch operator outside the backward is the step's accumulation of the rows."""
    from benchmarks.checksum_margin import DDP_STORE, ENGINES, OPS_COMMAND, STORE, render_ops

    text = (REPO / "docs" / "verification.md").read_text(encoding="utf-8")
    assert f"<!-- bench:checksum_host_ops:begin (generated by {OPS_COMMAND}" in text
    section = text.split("<!-- bench:checksum_host_ops:begin")[1].split("-->", 1)[1].split("<!-- bench:")[0]
    stored = json.loads(STORE.read_text())
    assert section.strip() == render_ops(stored, json.loads(DDP_STORE.read_text())).strip()
    for name in ENGINES:
        low, high = (stored[name][str(k)] for k in stored["ks"])
        grown = collections.Counter(high["distaccum"]["names"])
        grown.subtract(low["distaccum"]["names"])
        grown.subtract(high["expert"]["names"])
        grown.update(low["expert"]["names"])
        assert {op for op, n in grown.items() if n} <= {"aten::add_"}, (name, grown)


@pytest.mark.unit
def test_an_element_every_rank_left_at_zero_is_within_its_bound_until_it_is_reduced_to_something_else() -> (
    None
):
    """fp64: an exact-zero gradient (an unused embedding row, a dead ReLU) has a bound of 0 (its floor underflows);
    reduced to 0 it is within it, not 0/0; reduced to anything else it is not."""
    fp64 = Rounding(
        world=2, accum_steps=4, reduce=torch.float64, held=torch.float64, accumulate=torch.float64
    )
    exact = torch.tensor([[0.0, 3.0], [0.0, 3.0]], dtype=torch.float64)  # S and A of two sampled elements
    assert verdict(exact, torch.tensor([0.0, 3.0], dtype=torch.float64), fp64)[1] == 0.0
    assert verdict(exact, torch.tensor([1e-300, 3.0], dtype=torch.float64), fp64)[1] > 1.0
    assert verdict(exact, torch.tensor([float("nan"), 3.0], dtype=torch.float64), fp64)[1].isnan()


@pytest.mark.unit
def test_replicas_are_checked_each_on_its_own() -> None:
    """HSDP: every replica holds all of G; one replica's element out of its bound fails it, with its ratio."""
    rows = [[1.0, 0.5, 1.0], [0.5, 0.0, 0.5], [1.0, 3.0, 2.0], [0.5, 0.2, 1.0]]
    ok, ratios, worst = agree(rows, [[0, 1], [2, 3]])
    assert not ok and ratios == [1.0, 2.0] and worst == [0.5, 3.0]
    assert agree(rows[:2], [[0, 1]])[0]
    # A non-finite gradient is not judged here (the non-finite policy's).
    assert agree([[float("nan"), 9.0, 0.0], [0.0, 9.0, 0.0]], [[0, 1]])[0]


@pytest.mark.unit
def test_the_sample_is_the_same_everywhere_and_covers_every_tensor() -> None:
    numels = [10_000_000, 3, 1, 4096]
    first, again = sample_positions(numels), sample_positions(numels)
    assert all(torch.equal(p, q) for p, q in zip(first, again, strict=True))
    assert all(p[0] == 0 and len(p) >= 1 and int(p.max()) < n for p, n in zip(first, numels, strict=True))
    assert 4000 <= sum(len(p) for p in first) <= 4200


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


K16 = ("accum.steps=16",)
BF16 = {  # the bf16 reductions the old (K + W + 2) u bound let through at K = 16 with every gradient doubled
    "fsdp": ("accum.reduce_dtype=bf16",),  # fp32 compute: FSDP2 accumulates the window in bf16 itself
    "zero2": ("precision=bf16",),  # DeepSpeed reduces in the parameters' dtype: bf16
    "zero3": ("precision=bf16",),
}


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", list(BF16))
def test_a_doubled_bf16_reduction_stops_the_run_after_correct_bf16_steps(tmp_path: Path, engine: str) -> None:
    """One launch per engine serves both checks: steps 1 and 2 reduce correctly in bf16 (K = 16) and are not
    flagged; the reduction doubled from step 3 stops the run at step 3 with the ratio 2."""
    run = train(tmp_path, "bf16", engine, *K16, *BF16[engine], fault=corrupt("scale", 3, 2.0), steps=5)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-3000:]
    report = json.loads((run.run_dir / "divergence.json").read_text())
    assert (report["step"], report["parameter"]) == (3, "(reduction checksum)"), report
    assert report["ratio"] == pytest.approx(2.0, rel=1e-2) and report["bound_share"] > 1.0
    assert max(r["step"] for r in run.records) == 3  # steps 1-2 not flagged; stopped before step 4


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_correct_bf16_run_is_never_flagged(tmp_path: Path) -> None:
    """A bf16 reduction (FSDP2 accum.reduce_dtype=bf16, bf16 compute, K = 16), the tightest case of the exact local
    side: a false positive would fail the run (exit 1). Correct fp32 runs of every engine, boundary and every_micro,
    run with the check on in tests/test_engines.py (and the bug zoo's controls)."""
    run = train(tmp_path, "ok", "fsdp", *K16, "precision=bf16", "accum.reduce_dtype=bf16", steps=8)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert not (run.run_dir / "divergence.json").exists()
    assert len(run.records) == 8


HSDP = tuple(
    "engine=fsdp engine.replicas=2 trainer.nproc=4 model=mlp accum.micro_batch=1 accum.steps=2".split()
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
    every micro-batch's gradient (a = b > 0, v = 0 at every step; a frozen parameter takes no hook). If torch made new
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
                a, v, b = sums.tolist()
                assert a > 0 and v == 0.0 and a == b, (a, v, b)  # one rank: the reduction is a copy
        finally:
            engine.teardown()
