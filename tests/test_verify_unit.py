"""Verify library without launching runs: candidate planning, compare(), parameter digests, diagnosis rules."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from distaccum.components import Components, ModelRecipe
from distaccum.config import RunConfig, Split, from_mapping, to_mapping, valid_splits
from distaccum.datasets import SyntheticRegression
from distaccum.engines.base import Precision
from distaccum.guards.tripwire import check_consistency
from distaccum.losses import mse
from distaccum.models import MLP, ConvNetBN, TinyGPT
from distaccum.rundir import OLD_PARAM_DIGESTS, PARAM_DIGESTS
from distaccum.rundir.weights import load_weights
from distaccum.verify.candidates import (
    candidate_config,
    candidate_splits,
    parse_split,
    reference_config,
    write_seed_checkpoint,
)
from distaccum.verify.compare import (
    DEFAULT_TOLERANCES,
    Divergence,
    Report,
    RunData,
    Tolerance,
    Tolerances,
    compare,
    digest_gaps,
    reproducible,
    tolerance_for,
)
from distaccum.verify.diagnosis import (
    CAUSES,
    RunFacts,
    diagnose,
    model_facts,
    rule_batch_statistics,
    rule_loss_normalization,
    rule_nondeterminism,
    rule_randomness,
    unequal_items,
)

pytestmark = pytest.mark.unit

TOL = Tolerances(steps=Tolerance(rtol=1e-4, atol=1e-6), params=Tolerance(rtol=1e-3, atol=1e-5))


def make_cfg(**sections: dict) -> RunConfig:
    values = to_mapping(RunConfig())
    for section, fields in sections.items():
        if isinstance(fields, dict):
            values[section].update(fields)
        else:
            values[section] = fields
    return from_mapping(values)


# --- which runs -------------------------------------------------------------------------------------


def test_config_mode_runs_only_the_configured_split() -> None:
    cfg = make_cfg(accum={"micro_batch": 4, "steps": 4}, trainer={"nproc": 2})
    assert candidate_splits(cfg) == [Split(4, 4, 2)]


def test_auto_mode_covers_both_world_sizes_and_excludes_the_reference() -> None:
    cfg = make_cfg(
        accum={"micro_batch": 4, "steps": 4},
        trainer={"nproc": 2},
        verify={"splits": "auto", "max_candidates": 3},
    )
    splits = candidate_splits(cfg)
    assert splits[0] == Split(4, 4, 2) and len(splits) == 3 and len(set(splits)) == 3
    assert {s.world_size for s in splits} == {1, 2}
    assert all(s.global_batch == 32 for s in splits)

    everything = candidate_splits(replace(cfg, verify=replace(cfg.verify, max_candidates=100)))
    expected = {s for w in (1, 2) for s in valid_splits(32, w)} - {Split(32, 1, 1)}
    assert set(everything) == expected  # every valid split except the reference's own


def test_reference_and_candidate_configs(tmp_path: Path) -> None:
    cfg = make_cfg(
        accum={"micro_batch": 2, "steps": 4},
        trainer={"nproc": 2, "check_every": 0},
        verify={"reference_dtype": "fp64"},
        engine={"name": "fsdp"},
    )
    seed = tmp_path / "seed.safetensors"
    ref = reference_config(cfg, tmp_path / "ref", seed)
    assert ref.split() == Split(16, 1, 1)
    assert ref.precision == "fp64"
    cand = candidate_config(cfg, Split(1, 8, 2), tmp_path / "c", seed)
    assert cand.split() == Split(1, 8, 2)
    assert (cand.engine.name, cand.precision) == ("fsdp", "fp32")
    for run in (ref, cand):
        assert run.trainer.check_every == 1 and run.verify.record
        assert run.trainer.init_from == str(seed) and run.trainer.max_steps == cfg.trainer.max_steps


def test_split_labels_parse_back() -> None:
    assert parse_split("w2-m4-k4") == Split(4, 4, 2) and parse_split(Split(1, 8, 2).label()) == Split(1, 8, 2)
    for bad in ("w2-m4", "2-4-4", "w2-m4-k0", "w2-k4-m4"):
        with pytest.raises(ValueError, match="w<world>-m<micro_batch>-k<accum_steps>"):
            parse_split(bad)


def test_tolerances_per_precision_and_overrides() -> None:
    assert tolerance_for("fp64", make_cfg().verify) == DEFAULT_TOLERANCES["fp64"]
    fp32 = DEFAULT_TOLERANCES["fp32"]
    assert fp32.steps.rtol < fp32.params.rtol and DEFAULT_TOLERANCES["fp64"].params.rtol < fp32.steps.rtol
    custom = tolerance_for("fp32", make_cfg(verify={"rtol": 0.5}).verify)
    assert custom.steps == Tolerance(0.5, fp32.steps.atol) and custom.params == Tolerance(
        0.5, fp32.params.atol
    )


def test_seed_checkpoint_holds_the_models_initial_weights(tmp_path: Path) -> None:
    parts = Components(model=lambda: MLP(width=8), dataset=SyntheticRegression(8), loss=mse)
    write_seed_checkpoint(ModelRecipe(7, Precision.of("fp32")), parts, tmp_path / "seed.safetensors")
    state = load_weights(tmp_path / "seed.safetensors")
    torch.manual_seed(123)
    other = MLP(width=8)
    assert not torch.equal(other.state_dict()["net.0.weight"], state["net.0.weight"])
    other.load_state_dict(state)  # a full, loadable state dict
    torch.manual_seed(7)
    same = MLP(width=8)
    assert all(torch.equal(v, state[k]) for k, v in same.state_dict().items())


# --- compare ------------------------------------------------------------------------------------------


def fake_run(tmp: Path, steps: int = 4, seed: int = 0) -> RunData:
    gen = torch.Generator().manual_seed(seed)
    params = {
        "a.weight": torch.randn(8, 4, generator=gen, dtype=torch.float64),
        "b.bias": torch.randn(3, generator=gen, dtype=torch.float64),
    }
    records = [{"step": s, "loss": 2.0 / s, "grad_norm": 1.0 + s} for s in range(1, steps + 1)]
    digests = {
        s: {k: [float(v.sum()) * s, float((v * v).sum()) * s, v.numel()] for k, v in params.items()}
        for s in range(1, steps + 1)
    }
    return RunData(tmp, records, digests, params, None)


def clone(run: RunData) -> RunData:
    return RunData(
        run.run_dir,
        [dict(r) for r in run.records],
        {s: {k: list(v) for k, v in row.items()} for s, row in run.digests.items()},
        {k: v.clone() for k, v in run.params.items()} if run.params else None,
        run.divergence,
    )


def test_identical_runs_pass(tmp_path: Path) -> None:
    ref = fake_run(tmp_path)
    report = compare(ref, clone(ref), TOL)
    assert report.passed and report.first_divergence is None
    assert report.max_abs_diff == 0.0 and report.max_rel_diff == 0.0 and report.steps_compared == 4


def test_loss_divergence_names_first_step(tmp_path: Path) -> None:
    ref = fake_run(tmp_path)
    cand = clone(ref)
    cand.records[2]["loss"] *= 1.01  # step 3
    cand.records[3]["loss"] *= 1.01
    report = compare(ref, cand, TOL)
    assert not report.passed
    d = report.first_divergence
    assert (d.step, d.quantity) == (3, "loss")
    assert d.abs_diff == pytest.approx(abs(ref.records[2]["loss"] * 0.01))


def test_grad_norm_divergence_and_the_parameter_that_moved_furthest(tmp_path: Path) -> None:
    ref = fake_run(tmp_path)
    cand = clone(ref)
    cand.records[1]["grad_norm"] += 0.1
    cand.digests[2]["b.bias"][0] += 1e-3  # the tensor that moved at that step
    d = compare(ref, cand, TOL).first_divergence
    assert (d.step, d.quantity, d.parameter) == (2, "grad_norm", "b.bias")


def test_final_parameter_tolerance_boundary(tmp_path: Path) -> None:
    ref = fake_run(tmp_path)
    w = ref.params["a.weight"]
    allowed = TOL.params.bound(float(w.abs().max()))
    inside, outside = clone(ref), clone(ref)
    inside.params["a.weight"][0, 0] += 0.9 * allowed
    outside.params["a.weight"][0, 0] += 1.1 * allowed
    ok = compare(ref, inside, TOL)
    assert ok.passed and ok.max_abs_diff == pytest.approx(0.9 * allowed)
    bad = compare(ref, outside, TOL)
    assert not bad.passed and bad.worst_parameter == "a.weight"
    assert bad.max_rel_diff == pytest.approx(1.1 * allowed / float(w.abs().max()))
    assert (bad.first_divergence.quantity, bad.first_divergence.parameter) == ("parameter", "a.weight")


def test_checksum_gap_proves_a_divergence_only_when_it_must_exist(tmp_path: Path) -> None:
    ref = fake_run(tmp_path)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):  # perturbations inside the tolerance never trip the checksum test
        cand = {
            k: v
            + (torch.rand(v.shape, generator=gen, dtype=torch.float64) * 2 - 1)
            * TOL.params.bound(float(v.abs().max()))
            for k, v in ref.params.items()
        }
        sums = {k: [float(v.sum()), float((v * v).sum()), v.numel()] for k, v in cand.items()}
        base = {k: [float(v.sum()), float((v * v).sum()), v.numel()] for k, v in ref.params.items()}
        assert not any(proven for _, _, proven in digest_gaps(base, sums, TOL.params))
    shifted = dict(base, **{"b.bias": [base["b.bias"][0] + 10.0, base["b.bias"][1], 3]})
    gaps = digest_gaps(base, shifted, TOL.params)
    assert gaps[0][1:] == ("b.bias", True)
    at_step3 = {k: list(v) for k, v in ref.digests[3].items()}
    at_step3["b.bias"][0] += 10.0
    cand = RunData(tmp_path, ref.records, {**ref.digests, 3: at_step3}, ref.params, None)
    report = compare(ref, cand, TOL)
    assert not report.passed and report.max_abs_diff == 0.0  # final parameters agree
    d = report.first_divergence
    assert (d.step, d.quantity, d.parameter) == (3, "parameter", "b.bias")


def test_tripwire_report_and_missing_steps_fail(tmp_path: Path) -> None:
    ref = fake_run(tmp_path)
    stopped = RunData(
        tmp_path,
        ref.records[:1],
        {},
        None,
        {"step": 2, "parameter": "b.bias", "rank": 1, "message": "ranks diverged"},
    )
    report = compare(ref, stopped, TOL)
    assert not report.passed
    assert (
        report.first_divergence.step,
        report.first_divergence.quantity,
        report.first_divergence.parameter,
    ) == (2, "ranks", "b.bias")
    short = compare(ref, RunData(tmp_path, ref.records[:2], {}, ref.params, None), TOL)
    assert not short.passed and short.first_divergence.quantity == "missing"
    nan = clone(ref)
    nan.records[0]["loss"] = math.nan
    assert compare(ref, nan, TOL).first_divergence.step == 1


def test_reproducible_is_bitwise(tmp_path: Path) -> None:
    ref = fake_run(tmp_path)
    assert reproducible(ref, clone(ref))
    other = clone(ref)
    other.params["a.weight"][0, 0] = torch.nextafter(
        other.params["a.weight"][0, 0], torch.tensor(9.0).double()
    )
    assert not reproducible(ref, other)


# --- diagnosis --------------------------------------------------------------------------------------

FAILED = Report(False, 4, 0.1, 0.1, "a.weight", 0.1, 0.1, Divergence(1, "grad_norm", "a.weight"))
SPLIT = Split(4, 4, 2)


def test_rules_fire_only_on_their_cause() -> None:
    bn = RunFacts(batch_stat_layers=("features.1",))
    assert "features.1" in rule_batch_statistics(bn, SPLIT).message
    assert rule_batch_statistics(bn, Split(32, 1, 1)) is None
    assert rule_batch_statistics(RunFacts(), SPLIT) is None

    mean = RunFacts(loss_norm="mean_per_micro")
    assert "at step 1" in rule_loss_normalization(mean, "at step 1 the 8 micro-batches hold 3 to 9").message
    assert rule_loss_normalization(mean, None) is None
    assert rule_loss_normalization(RunFacts(), "at step 1 ...") is None

    drop = RunFacts(random_layers=("net.4",))
    assert "net.4" in rule_randomness(drop, SPLIT).message
    assert rule_randomness(RunFacts(), SPLIT) is None

    assert rule_nondeterminism(RunFacts(reference_reproducible=False)).cause == "nondeterminism"
    assert rule_nondeterminism(RunFacts(reference_reproducible=True)) is None
    assert rule_nondeterminism(RunFacts()) is None


def test_diagnose_combines_rules_and_falls_back() -> None:
    assert diagnose(replace(FAILED, passed=True), RunFacts(batch_stat_layers=("bn",)), SPLIT, None) == []
    facts = RunFacts(batch_stat_layers=("bn",), random_layers=("drop",), reference_reproducible=False)
    causes = [f.cause for f in diagnose(FAILED, facts, SPLIT, None)]
    assert causes == ["batch_statistics", "randomness", "nondeterminism"]
    tripped = replace(FAILED, first_divergence=Divergence(3, "ranks", "tok.weight"))
    [finding] = diagnose(tripped, RunFacts(), SPLIT, None)
    assert (
        finding.cause == "rank_divergence" and "step 3" in finding.message and "tok.weight" in finding.message
    )
    assert [f.cause for f in diagnose(FAILED, RunFacts(), SPLIT, None, exit_code=1)] == ["run_failed"]
    crashed_bn = diagnose(FAILED, RunFacts(batch_stat_layers=("bn",)), SPLIT, None, exit_code=1)
    assert [f.cause for f in crashed_bn] == ["run_failed", "batch_statistics"]
    assert [f.cause for f in diagnose(tripped, RunFacts(), SPLIT, None, exit_code=1)] == ["rank_divergence"]
    assert [f.cause for f in diagnose(FAILED, RunFacts(), SPLIT, None)] == ["unexplained"]
    assert {f.cause for f in diagnose(FAILED, facts, SPLIT, None)} <= set(CAUSES)


def test_facts_from_models_and_the_records() -> None:
    bn = model_facts(ConvNetBN(), "global_count")
    assert bn.batch_stat_layers == ("features.1", "features.4") and bn.random_layers == ()
    drop = model_facts(MLP(dropout=0.1), "global_count")
    assert drop.random_layers and not drop.batch_stat_layers
    attention = model_facts(TinyGPT(dropout=0.1), "global_count")  # functional dropout in attention
    assert {"blocks.0", "blocks.0.drop"} <= set(attention.random_layers)
    records = [
        {"step": 1, "micro_steps": 4, "micro_items_min": 20, "micro_items_max": 20},
        {"step": 2, "micro_steps": 4, "micro_items_min": 12, "micro_items_max": 31},
    ]
    assert unequal_items(records) == "at step 2 the 4 micro-batches per rank hold 12 to 31 loss items"
    assert unequal_items(records[:1]) is None


# --- the tripwire's recording (single process; the multi-rank path runs in test_verify.py) -----------


class _Params:
    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def full_parameters(self):  # the one Backend method the tripwire uses
        return ((n, p.detach()) for n, p in self.module.named_parameters())


def test_single_process_records_param_digests(tmp_path: Path) -> None:
    module = torch.nn.Linear(3, 2)
    check_consistency(_Params(module), 1, tmp_path)  # world 1, not recording: nothing to do
    assert not (tmp_path / PARAM_DIGESTS).exists()
    check_consistency(_Params(module), 1, tmp_path, record=True)
    check_consistency(_Params(module), 2, tmp_path, record=True)
    rows = [json.loads(line) for line in (tmp_path / PARAM_DIGESTS).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    s, q, n = rows[0]["params"]["weight"]
    w = module.weight.detach().double()
    assert (s, q, n) == (pytest.approx(float(w.sum())), pytest.approx(float((w * w).sum())), 6)


def test_tripwire_error_carries_step_and_parameter_through_pickle() -> None:
    import pickle

    from distaccum.guards.tripwire import RankDivergenceError

    err = pickle.loads(pickle.dumps(RankDivergenceError("ranks diverged", step=3, parameter="w", rank=1)))
    assert (str(err), err.step, err.parameter, err.rank) == ("ranks diverged", 3, "w", 1)


def test_a_ramped_candidate_keeps_the_global_batch_the_ramp_ends_at(tmp_path: Path) -> None:
    """The ramp's verify rule (batching/verify_rules.py): a run at a split keeps accum.global_batch; others drop it."""
    ramp = {"points": [[1, 8], [3, 16]]}
    cfg = make_cfg(
        accum={"micro_batch": 2, "steps": 4, "global_batch": 16, "ramp": ramp}, trainer={"nproc": 2}
    )
    cand = candidate_config(cfg, Split(2, 4, 2), tmp_path, tmp_path / "seed")
    assert cand.accum.global_batch == 16 and cand.accum.micro_batch == 2 and cand.accum.steps == 4
    plain = candidate_config(
        make_cfg(accum={"micro_batch": 2, "steps": 4}), Split(2, 4, 2), tmp_path, tmp_path
    )
    assert plain.accum.global_batch is None


def test_parameter_digests_under_their_old_file_name_are_read(tmp_path: Path) -> None:
    """Issue 57: verify's per-step parameter record was ``checksums.jsonl`` before; a run that wrote it compares."""
    check_consistency(_Params(torch.nn.Linear(3, 2)), 1, tmp_path, record=True)
    (tmp_path / PARAM_DIGESTS).rename(tmp_path / OLD_PARAM_DIGESTS)
    digests = RunData.load(tmp_path).digests
    assert list(digests) == [1] and set(digests[1]) == {"weight", "bias"} and digests[1]["weight"][2] == 6
