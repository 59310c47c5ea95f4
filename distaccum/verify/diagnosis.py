"""Why a verify candidate differs from the reference: facts about the run, and one pure rule per cause.

Facts come from the configuration alone (a freshly built model, the data plan) or from files the
runs wrote (the tripwire's report, a second reference run); nothing here launches anything. Each
rule returns a :class:`Finding` or None, so tests can check every rule with hand-made facts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from distaccum.config import Split
from distaccum.models import batch_stat_layers, random_layers
from distaccum.verify.compare import Report

CAUSES = ("rank_divergence", "batch_statistics", "loss_normalization", "gradient_scale", "partial_window",
          "randomness", "nondeterminism", "run_failed", "unexplained")


@dataclass(frozen=True)
class Finding:
    """One likely cause of a mismatch."""

    cause: str
    """One of :data:`CAUSES`."""
    message: str
    """What was found, naming layers/steps, and what to do about it."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunFacts:
    """What the rules need to know about the configuration (shared by every candidate)."""

    batch_stat_layers: tuple[str, ...] = ()
    random_layers: tuple[str, ...] = ()
    loss_norm: str = "global_count"
    reference_reproducible: bool | None = None
    """None: not checked; False: two identical reference runs differed (non-deterministic kernels)."""


@dataclass(frozen=True)
class StepFacts:
    """What the candidate's and the reference's records say about where they part."""

    first_step_ratio: float | None = None
    """Candidate / reference grad_norm at step 1 when the step-1 losses agree (same weights, same
    samples): a constant factor there is a normalization constant, not a split effect."""
    partial_step: int | None = None
    """The first divergent step when it is a partial window and every earlier step agreed."""


def step_facts(report: Report, ref: list[dict[str, Any]], cand: list[dict[str, Any]],
               rtol: float) -> StepFacts:
    """Read :class:`StepFacts` off the two runs' per-step records."""
    ratio = None
    if ref and cand and ref[0].get("grad_norm") and abs(cand[0]["loss"] - ref[0]["loss"]) <= rtol * abs(ref[0]["loss"]):
        r = cand[0]["grad_norm"] / ref[0]["grad_norm"]
        ratio = r if abs(r - 1.0) > 10 * rtol else None
    partial = None
    first = report.first_divergence
    if first is not None and first.quantity != "ranks" and 1 < first.step <= len(cand):
        if cand[first.step - 1].get("partial_window"):
            partial = first.step
    return StepFacts(ratio, partial)


def model_facts(model: nn.Module, loss_norm: str) -> RunFacts:
    """Facts read off a freshly built model (cheap: no training, no processes)."""
    return RunFacts(tuple(batch_stat_layers(model)), tuple(random_layers(model)), loss_norm)


def unequal_items(records: list[dict[str, Any]]) -> str | None:
    """The first optimizer step whose micro-batches held different numbers of loss items, described.

    Read from a run's records (``micro_items_min`` / ``micro_items_max`` over every rank's
    micro-batches), so it holds for any dataset and loss.
    """
    for record in records:
        low, high = record.get("micro_items_min"), record.get("micro_items_max")
        if low is not None and high is not None and low != high:
            return (f"at step {record['step']} the {record.get('micro_steps', '?')} micro-batches per rank hold "
                    f"{low} to {high} loss items")
    return None


def rule_rank_divergence(report: Report) -> Finding | None:
    """The tripwire fired: ranks held different parameters after a step."""
    d = report.first_divergence
    if d is None or d.quantity != "ranks":
        return None
    return Finding("rank_divergence",
                   f"ranks diverged after optimizer step {d.step} at parameter {d.parameter!r} (cross-rank "
                   "checksum tripwire): gradients were not reduced identically on every rank — a skipped "
                   "or misplaced reduction (no_sync on the boundary), or rank-dependent code.")


def rule_batch_statistics(facts: RunFacts, split: Split) -> Finding | None:
    """Batch-statistics layers see micro-batches, not the effective batch."""
    if not facts.batch_stat_layers or split.accum_steps * split.world_size == 1:
        return None
    names = ", ".join(facts.batch_stat_layers)
    return Finding("batch_statistics",
                   f"batch-statistics layers ({names}) normalize over each micro-batch of "
                   f"{split.micro_batch} samples on each rank, the reference over all {split.global_batch}: "
                   "the forward pass itself depends on the split. Use GroupNorm/LayerNorm, or accept "
                   "the difference (SyncBatchNorm fixes ranks, not accumulation).")


def rule_loss_normalization(facts: RunFacts, unequal: str | None) -> Finding | None:
    """mean_per_micro weights micro-batches equally although they hold different item counts."""
    if facts.loss_norm != "mean_per_micro" or unequal is None:
        return None
    return Finding("loss_normalization",
                   f"accum.loss_norm=mean_per_micro averages each micro-batch and divides by K x world, "
                   f"but {unequal}: items in small micro-batches are over-weighted. "
                   "Use accum.loss_norm=global_count (sum over the window / global item count).")


def rule_gradient_scale(facts: RunFacts, steps: StepFacts) -> Finding | None:
    """Same loss, same weights, same samples at step 1 — and a gradient off by a constant factor."""
    if steps.first_step_ratio is None or facts.loss_norm == "mean_per_micro" or facts.batch_stat_layers \
            or facts.random_layers:
        return None
    return Finding("gradient_scale",
                   f"at step 1 the loss matches the reference but the gradient is {steps.first_step_ratio:.6g}x "
                   "the reference's: the gradient is normalized by a wrong constant (the loss divided twice, by "
                   "K or by the world size, or an engine's own averaging not undone). It does not depend on the "
                   "split, so every split shows it.")


def rule_partial_window(steps: StepFacts) -> Finding | None:
    """Every full window matches; the first mismatch is a partial (remainder) window."""
    if steps.partial_step is None:
        return None
    return Finding("partial_window",
                   f"every step before {steps.partial_step} matches and step {steps.partial_step} is a partial window: "
                   "it is normalized as if it were full (scaled by K or by the nominal batch) instead of by the "
                   "items it holds. Keep data.drop_last=false only with a count-based normalization.")


def rule_randomness(facts: RunFacts, split: Split) -> Finding | None:
    """Dropout masks are drawn per micro-batch and per rank, so they depend on the split."""
    if not facts.random_layers or split.accum_steps * split.world_size == 1:
        return None
    return Finding("randomness",
                   f"random layers ({', '.join(facts.random_layers)}) draw their masks per micro-batch and "
                   "per rank, so a different split sees different masks. Verify with model.dropout=0.")


def rule_nondeterminism(facts: RunFacts) -> Finding | None:
    """Two reference runs of the same configuration differed."""
    if facts.reference_reproducible is not False:
        return None
    return Finding("nondeterminism",
                   "the reference run is not reproducible (two identical runs differed): non-deterministic "
                   "kernels (e.g. atomics in CUDA scatter/embedding backward). Set "
                   "torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG, or widen the "
                   "tolerance to the run-to-run spread.")


def diagnose(report: Report, facts: RunFacts, split: Split, unequal: str | None,
             exit_code: int = 0, steps: StepFacts | None = None) -> list[Finding]:
    """Every finding that explains a failed ``report`` (empty when it passed)."""
    if report.passed:
        return []
    steps = steps or StepFacts()
    tripwire = rule_rank_divergence(report)
    findings = [f for f in (
        tripwire,
        rule_batch_statistics(facts, split),
        rule_loss_normalization(facts, unequal),
        rule_gradient_scale(facts, steps),
        rule_partial_window(steps),
        rule_randomness(facts, split),
        rule_nondeterminism(facts),
    ) if f is not None]
    if exit_code and tripwire is None:  # a crash comes first: nothing after it was compared
        findings.insert(0, Finding("run_failed", f"the candidate run failed (exit {exit_code}); its "
                                                 "output is in console.log in its run directory."))
    if findings:
        return findings
    return [Finding("unexplained",
                    f"no known cause found (max_rel_diff {report.max_rel_diff:.3g}). If the difference is "
                    "small it may be rounding amplified by the optimizer: rerun with precision=fp64 (a bug "
                    "keeps its size, rounding shrinks to ~1e-12) or verify.reference_dtype=fp64.")]
