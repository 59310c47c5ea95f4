"""Why a verify candidate differs from the reference: facts about the run, and one pure rule per cause.

Facts come from the configuration alone (a freshly built model, the data order), from files the runs
wrote (the tripwire's or the fingerprint's report, the runtime warnings, the console's last lines, a
second reference run) or from a replay of step 1 (:mod:`distaccum.verify.replay`); nothing here launches
anything. Each rule returns a :class:`Finding` or None, so tests can check every rule with hand-made
facts. ``distaccum bugzoo`` (:mod:`distaccum.verify.bugzoo`) checks them against real injected bugs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

from distaccum.config import Split
from distaccum.guards.reduction_count import EXTRA
from distaccum.models import batch_stat_layers, random_layers
from distaccum.verify.compare import Report

CAUSES = (
    "rank_divergence",
    "known_error",
    "shared_data",
    "shared_rng",
    "reduction_count",
    "batch_statistics",
    "loss_normalization",
    "lr_schedule",
    "stale_gradients",
    "lost_gradients",
    "clipping",
    "gradient_scale",
    "partial_window",
    "outer_sign_flipped",
    "outer_sum_as_mean",
    "randomness",
    "nondeterminism",
    "run_failed",
    "unexplained",
)

KNOWN_ERRORS = {
    "expect_autograd_hooks_ INTERNAL ASSERT FAILED": (
        "DistributedDataParallel(static_graph=True) with no_sync(): torch (2.13 included) fails the first backward "
        "under no_sync with this internal assert (pytorch/pytorch#187732). Past the assert, the same bug silently "
        "stops DDP's all-reduce from the second window on — the reduction fingerprint stops such a run at its "
        "first unreduced step. Do not combine static_graph=True with no_sync gradient accumulation."
    ),
    "No inf checks were recorded prior to update": (
        "GradScaler.update() ran with no unscale_()/step() since the previous update: the scaler is updated per "
        "micro-batch. Update it once per optimizer step, after step() (distaccum's engines do)."
    ),
    "DeepSpeed's gradient_clipping is": (
        "DeepSpeed's clipping is not the run's optim.clip_norm: the config reached deepspeed.initialize without "
        "distaccum's gradient_clipping (0.0 when clip_norm is null), so DeepSpeed's default applied, 1.0 since "
        "DeepSpeed #8068, and would clip a run that never asked for it. Always pass gradient_clipping explicitly."
    ),
}
"""Error signatures in a failed run's console, and what they mean."""


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
    items: tuple[float, float, int, int] | None = None
    """(candidate, reference) loss items of step 1 when they differ, with the window's samples and its
    non-empty micro-batches over all ranks."""
    lr: tuple[int, float, float] | None = None
    """(step, candidate, reference) learning rate at the first step where they differ."""
    stale_step: int | None = None
    """A full window s > 1 whose gradient norm differs while its loss and learning rate match and every
    earlier step agreed: the weights and samples were the reference's, the gradient was not."""
    warnings: tuple[tuple[str, str], ...] = ()
    """The run's runtime warnings: (check, message) (``warnings.jsonl``)."""
    console: str = ""
    """The last lines of a failed run's console."""
    replayed: tuple[tuple[str, str], ...] = ()
    """(cause, message) of each known wrong combination of step 1's micro-batch gradients that reproduces
    the candidate's gradient norm while the correct one does not (:mod:`distaccum.verify.replay`)."""
    outer_merge: tuple[int, float, int, float] | None = None
    """(step, f, islands, residual) of a diloco candidate that first parts from the simulator right after a fragment's
    first outer sync: its outer step moved the parameters f times as far from the seed as the simulator's, leaving
    ``residual`` of its movement unexplained by that one slope (:mod:`distaccum.verify.outer_merge`)."""


def _close(a: Any, b: Any, rtol: float) -> bool:
    return isinstance(a, int | float) and isinstance(b, int | float) and abs(a - b) <= rtol * abs(b) + 1e-12


def step_facts(
    report: Report,
    ref: list[dict[str, Any]],
    cand: list[dict[str, Any]],
    rtol: float,
    split: Split | None = None,
) -> StepFacts:
    """Read :class:`StepFacts` off the two runs' per-step records (``split``: the candidate's)."""
    ratio = None
    if ref and cand and ref[0].get("grad_norm") and _close(cand[0]["loss"], ref[0]["loss"], rtol):
        r = cand[0]["grad_norm"] / ref[0]["grad_norm"]
        ratio = r if abs(r - 1.0) > 10 * rtol else None
    partial = stale = None
    first = report.first_divergence
    if first is not None and first.quantity != "ranks" and 1 < first.step <= len(cand):
        c, r = cand[first.step - 1], ref[first.step - 1]
        if c.get("partial_window"):
            partial = first.step
        elif (
            _close(c["loss"], r["loss"], rtol)
            and not _close(c["grad_norm"], r["grad_norm"], rtol)
            and _close(c["lr"], r["lr"], 1e-9)
        ):
            stale = first.step
    items = None
    if ref and cand and cand[0].get("items") != ref[0].get("items"):
        samples = int(ref[0].get("samples", 0))
        pieces = min(samples, split.accum_steps * split.world_size) if split else 0
        items = (float(cand[0]["items"]), float(ref[0]["items"]), samples, pieces)
    lr = next(
        (
            (int(r["step"]), c["lr"], r["lr"])
            for r, c in zip(ref, cand, strict=False)
            if not _close(c.get("lr"), r.get("lr"), 1e-9)
        ),
        None,
    )
    return StepFacts(ratio, partial, items, lr, stale)


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
            return (
                f"at step {record['step']} the {record.get('micro_steps', '?')} micro-batches per rank hold "
                f"{low} to {high} loss items"
            )
    return None


def rule_rank_divergence(report: Report) -> Finding | None:
    """The tripwire fired: ranks held different parameters after a step."""
    d = report.first_divergence
    if d is None or d.quantity != "ranks":
        return None
    return Finding(
        "rank_divergence",
        f"ranks diverged at optimizer step {d.step} at parameter {d.parameter!r} (the reduction "
        "fingerprint or the cross-rank parameter-digest tripwire): gradients were not reduced identically on every rank — a skipped "
        "or misplaced reduction (no_sync on the boundary), or rank-dependent code.",
    )


def rule_known_error(steps: StepFacts) -> Finding | None:
    """The run failed with an error whose signature is known."""
    for signature, meaning in KNOWN_ERRORS.items():
        if signature in steps.console:
            return Finding("known_error", f"the run failed with {signature!r}: {meaning}")
    return None


def rule_runtime_warnings(steps: StepFacts) -> list[Finding]:
    """The fingerprint saw identical data or identical random numbers on every rank; the reduction count saw more
    (or fewer) reducing micro-batches than ``accum.sync`` promises."""
    causes = {"same_samples": "shared_data", "same_rng": "shared_rng", "reduction_count": "reduction_count"}
    return [Finding(causes[check], message) for check, message in steps.warnings if check in causes]


def rule_reduction_count(steps: StepFacts) -> list[Finding]:
    """The reduction count's warning alone: what a run whose weights agree with the reference can still be wrong in
    (its cost: K reductions where one was promised)."""
    return [f for f in rule_runtime_warnings(steps) if f.cause == "reduction_count"]


def rule_item_count(facts: RunFacts, steps: StepFacts) -> Finding | None:
    """The candidate normalised step 1 by a different number of loss items than the reference counts."""
    if (
        steps.items is None
        or facts.loss_norm == "mean_per_micro"
        or any(check == "same_samples" for check, _ in steps.warnings)
    ):
        return None
    cand, ref, samples, pieces = steps.items
    if cand == pieces:
        what = (
            f"one item per micro-batch ({pieces} micro-batches): each micro-batch's loss is a mean over its own "
            "items and the window averages the micro-batch means (loss/K), so items of small micro-batches "
            "weigh more"
        )
    elif cand == samples:
        what = (
            f"one item per sample ({samples} samples): the loss is a mean over samples, not over the "
            f"{ref:.0f} loss items (tokens) the samples hold"
        )
    else:
        what = f"{cand:.0f} items where the reference counts {ref:.0f}"
    return Finding(
        "loss_normalization",
        f"step 1 is normalised by the wrong number of loss items: {what}. Return the SUM of the loss "
        "and the number of loss items it covers; distaccum divides by the window's global count.",
    )


def rule_lr_schedule(steps: StepFacts) -> Finding | None:
    """The learning rate of some step differs from the reference's schedule."""
    if steps.lr is None:
        return None
    step, cand, ref = steps.lr
    return Finding(
        "lr_schedule",
        f"the learning rate of step {step} is {cand:.6g}, the reference's schedule gives {ref:.6g}: the "
        "schedule advanced more (or less) than once per optimizer step, e.g. stepped per micro-batch. "
        "Step it once per optimizer step (a skipped step must not advance it).",
    )


def rule_stale_gradients(steps: StepFacts) -> Finding | None:
    """A later full window's gradient differs although its weights, samples and learning rate agree."""
    if steps.stale_step is None:
        return None
    s = steps.stale_step
    return Finding(
        "stale_gradients",
        f"every step before {s} matches and step {s}'s loss and learning rate match too (same weights, "
        f"same samples), but its gradient differs: something of an earlier window leaked into step {s}'s "
        "gradient — gradients not zeroed after the optimizer step.",
    )


def rule_replay(steps: StepFacts) -> list[Finding]:
    """Known wrong combinations of step 1's micro-batch gradients that reproduce the candidate's norm."""
    return [
        Finding(
            cause,
            f"step 1 replayed from the seed weights, micro-batch by micro-batch: the candidate's "
            f"gradient norm is exactly what you get when {message} (combined correctly, it is the "
            "reference's)",
        )
        for cause, message in steps.replayed
    ]


def rule_batch_statistics(facts: RunFacts, split: Split) -> Finding | None:
    """Batch-statistics layers see micro-batches, not the effective batch."""
    if not facts.batch_stat_layers or split.accum_steps * split.world_size == 1:
        return None
    names = ", ".join(facts.batch_stat_layers)
    return Finding(
        "batch_statistics",
        f"batch-statistics layers ({names}) normalize over each micro-batch of "
        f"{split.micro_batch} samples on each rank, the reference over all {split.global_batch}: "
        "the forward pass itself depends on the split. Use GroupNorm/LayerNorm, or accept "
        "the difference (SyncBatchNorm fixes ranks, not accumulation).",
    )


def rule_loss_normalization(facts: RunFacts, unequal: str | None) -> Finding | None:
    """mean_per_micro weights micro-batches equally although they hold different item counts."""
    if facts.loss_norm != "mean_per_micro" or unequal is None:
        return None
    return Finding(
        "loss_normalization",
        f"accum.loss_norm=mean_per_micro averages each micro-batch and divides by K x world, "
        f"but {unequal}: items in small micro-batches are over-weighted. "
        "Use accum.loss_norm=global_count (sum over the window / global item count).",
    )


def simple_fraction(ratio: float, rtol: float, largest: int = 64) -> tuple[int, int] | None:
    """(p, q) with p, q <= ``largest`` and ``|ratio - p/q| <= rtol * ratio``, the smallest q first; None if none."""
    for q in range(1, largest + 1):
        p = round(ratio * q)
        if 1 <= p <= largest and abs(ratio - p / q) <= rtol * ratio:
            return p, q
    return None


def rule_gradient_scale(facts: RunFacts, steps: StepFacts, rtol: float = 1e-4) -> Finding | None:
    """Same loss, same weights, same samples at step 1 — and a gradient off by a constant factor: a small
    fraction (K, the world size, 1/K, 2, ...). Any other ratio is not a normalisation constant."""
    if (
        steps.first_step_ratio is None
        or facts.loss_norm == "mean_per_micro"
        or facts.batch_stat_layers
        or facts.random_layers
        or steps.replayed
        or simple_fraction(steps.first_step_ratio, rtol) is None
    ):
        return None
    return Finding(
        "gradient_scale",
        f"at step 1 the loss matches the reference but the gradient is {steps.first_step_ratio:.6g}x "
        "the reference's: the gradient is normalized by a wrong constant (the loss divided twice, by "
        "K or by the world size, or an engine's own averaging not undone). It does not depend on the "
        "split, so every split shows it.",
    )


def rule_partial_window(steps: StepFacts) -> Finding | None:
    """Every full window matches; the first mismatch is a partial (remainder) window."""
    if steps.partial_step is None:
        return None
    return Finding(
        "partial_window",
        f"every step before {steps.partial_step} matches and step {steps.partial_step} is a partial window: "
        "it is normalized as if it were full (scaled by K or by the nominal batch) instead of by the "
        "items it holds. Keep data.drop_last=false only with a count-based normalization.",
    )


def rule_outer_merge(steps: StepFacts, rtol: float = 1e-4) -> Finding | None:
    """The first outer step moved the parameters -1 or R (the islands) times as far as the simulator's: the
    pseudo-gradient's sign flipped, or the islands' SUM used as their mean. Any other factor is not named.

    The bound. A candidate whose outer step is the simulator's times f moves the parameters' sums by c = f (r + e):
    r the simulator's movement, e what the islands' inner steps leave it off by (the same math in another order).
    The outer step is linear, so e keeps its relative size through it. A factor is named only when e is as small as
    verify requires of the run's other whole-model numbers, ||e|| <= rtol ||r|| with ``rtol`` the step tolerance
    (its bar for the loss and the gradient norm, met by every step before the merge; a correct outer step leaves
    1.4e-5 in the zoo's fp32 DiLoCo runs, rtol 1e-4). Then the least-squares slope is off f by at most
    |<f e, r>| / ||r||^2 <= |f| rtol (Cauchy-Schwarz) and leaves a residual ||c - slope r|| <= ||f e|| <=
    rtol ||c|| (1 + rtol) (the slope minimizes it): -1 is named when |slope + 1| <= rtol, R when
    |slope - R| <= R rtol, both only with a residual of at most rtol (1 + rtol). A merge that weighs the islands
    otherwise is no multiple of the simulator's: the zoo's DiLoCo bugs with equal weights where the islands' token
    counts differ leave slopes -0.99888 and 1.99776 and a residual of 8.3e-4; named by no rule, they stay
    unexplained. (The bound was 1e-2 on both before issue 58, which named them.)"""
    if steps.outer_merge is None:
        return None
    step, f, islands, residual = steps.outer_merge
    if residual > rtol * (1 + rtol):
        return None
    moved = (
        f"at step {step}, the first outer sync (everything before the merge matches the simulator), the outer step "
        f"moved the parameters {f:.4g} times as far from the seed checkpoint as the simulator's"
    )
    if abs(f + 1) <= rtol:
        return Finding(
            "outer_sign_flipped",
            f"{moved}: the opposite way. The pseudo-gradient was taken as local - global; DiLoCo's is global - "
            "local (theta_g - theta_i), which the outer SGD descends along (torchft #233). Flip the subtraction.",
        )
    if islands > 1 and abs(f - islands) <= rtol * islands:
        return Finding(
            "outer_sum_as_mean",
            f"{moved}: the {islands} islands' all-reduced SUM of pseudo-gradients was used as their "
            "mean (torchft #286). Divide the sum by the islands' total weight (R for a plain mean), or weight each "
            "island by n_i / sum_j n_j before a SUM.",
        )
    return None


def rule_randomness(facts: RunFacts, split: Split) -> Finding | None:
    """Dropout masks are drawn per micro-batch and per rank, so they depend on the split."""
    if not facts.random_layers or split.accum_steps * split.world_size == 1:
        return None
    return Finding(
        "randomness",
        f"random layers ({', '.join(facts.random_layers)}) draw their masks per micro-batch and "
        "per rank, so a different split sees different masks. Verify with model.dropout=0.",
    )


def rule_nondeterminism(facts: RunFacts) -> Finding | None:
    """Two reference runs of the same configuration differed."""
    if facts.reference_reproducible is not False:
        return None
    return Finding(
        "nondeterminism",
        "the reference run is not reproducible (two identical runs differed): non-deterministic "
        "kernels (e.g. atomics in CUDA scatter/embedding backward). Set "
        "torch.use_deterministic_algorithms(True) and CUBLAS_WORKSPACE_CONFIG, or widen the "
        "tolerance to the run-to-run spread.",
    )


def diagnose(
    report: Report,
    facts: RunFacts,
    split: Split,
    unequal: str | None,
    exit_code: int = 0,
    steps: StepFacts | None = None,
    rtol: float = 1e-4,
) -> list[Finding]:
    """Every finding that explains a failed ``report``; when it passed, only the reduction count's (a run can match
    the reference and still reduce K times a step), else nothing."""
    steps = steps or StepFacts()
    if report.passed:
        return rule_reduction_count(steps)
    tripwire = rule_rank_divergence(report)
    known = rule_known_error(steps) if exit_code else None
    # K reductions where one was promised: the reduced gradient then rounds like K reductions, which the reduction
    # checksum (held to one reduction's rounding) stops on too. The count names the cause, the checksum's stop is
    # its consequence: the count comes first.
    extra = [f for f in rule_reduction_count(steps) if EXTRA in f.message]
    findings = [
        f
        for f in (
            *extra,
            tripwire,
            known,
            *(f for f in rule_runtime_warnings(steps) if f not in extra),
            rule_batch_statistics(facts, split),
            rule_loss_normalization(facts, unequal),
            rule_item_count(facts, steps),
            rule_lr_schedule(steps),
            rule_stale_gradients(steps),
            *rule_replay(steps),
            rule_gradient_scale(facts, steps, rtol),
            rule_partial_window(steps),
            rule_outer_merge(steps, rtol),
            rule_randomness(facts, split),
            rule_nondeterminism(facts),
        )
        if f is not None
    ]
    findings = [
        f for i, f in enumerate(findings) if f.cause not in {g.cause for g in findings[:i]}
    ]  # first per cause
    if exit_code and tripwire is None and known is None:  # a crash comes first: nothing after it was compared
        findings.insert(
            0,
            Finding(
                "run_failed",
                f"the candidate run failed (exit {exit_code}); its "
                "output is in console.log in its run directory.",
            ),
        )
    if findings:
        return findings
    return [
        Finding(
            "unexplained",
            f"no known cause found (max_rel_diff {report.max_rel_diff:.3g}). If the difference is "
            "small it may be rounding amplified by the optimizer: rerun with precision=fp64 (a bug "
            "keeps its size, rounding shrinks to ~1e-12) or verify.reference_dtype=fp64.",
        )
    ]
