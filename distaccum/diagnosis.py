"""Why a verify candidate differs from the reference: facts about the run, and one pure rule per cause.

Facts come from the configuration alone (a freshly built model, the data plan) or from files the
runs wrote (the tripwire's report, a second reference run); nothing here launches anything. Each
rule returns a :class:`Finding` or None, so tests can check every rule with hand-made facts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from distaccum.config import RunConfig, Split
from distaccum.verify import Report

CAUSES = ("rank_divergence", "batch_statistics", "loss_normalization", "randomness",
          "nondeterminism", "run_failed", "unexplained")


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


def model_facts(cfg: RunConfig) -> RunFacts:
    """Facts read off a freshly built model of ``cfg`` (cheap: no training, no processes)."""
    from distaccum.models import batch_stat_layers, build_model, random_layers

    model, _ = build_model(cfg.model, cfg.data)
    return RunFacts(tuple(batch_stat_layers(model)), tuple(random_layers(model)), cfg.accum.loss_norm)


def unequal_items(cfg: RunConfig, split: Split, steps: int) -> str | None:
    """The first optimizer step whose micro-batches hold different numbers of loss items, described.

    Read from the data plan (the same windows the runs consume), so nothing has to run.
    """
    from distaccum.data import GlobalBatchPlan, build_dataset

    dataset = build_dataset(cfg.model, cfg.data)
    plan = GlobalBatchPlan(len(dataset), split.global_batch, seed=cfg.trainer.seed,
                           shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
    for step in range(steps):
        window = plan.window(step)
        counts = [dataset.collate(ix).items for rank in range(split.world_size)
                  for ix in window.rank_micro_batches(split, rank)]
        if min(counts) != max(counts):
            return (f"at step {step + 1} the {len(counts)} micro-batches hold {min(counts)} to "
                    f"{max(counts)} loss items")
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
             exit_code: int = 0) -> list[Finding]:
    """Every finding that explains a failed ``report`` (empty when it passed)."""
    if report.passed:
        return []
    tripwire = rule_rank_divergence(report)
    findings = [f for f in (
        tripwire,
        rule_batch_statistics(facts, split),
        rule_loss_normalization(facts, unequal),
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
