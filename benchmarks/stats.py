"""From block step times to per-round times, per-round ratios, medians and spreads.

A round's time of a variant is the median of its block's step times (a stray slow step, a
garbage collection, does not move it). A ratio is taken *per round*, between two blocks that ran
seconds apart in the same processes, so slow drift of the machine cancels in it; the reported
figure is the median of the per-round ratios, with its spread: min-max and the interquartile range
(IQR, the middle half of the rounds). With 8 rounds the IQR spans rounds 3-6 by rank.

Whether a target is met is a question about the median, not about single rounds: the verdict reads the
median's 95 % confidence interval (:func:`median_interval`, distribution-free: two order statistics), which
narrows as rounds are added, where the IQR only describes how far single rounds scatter (about +-5 % on this
project's 2-core machine, for two identical loops too: the ``ddp_no_sync_twin`` control). With 8 rounds the
interval is min-max; with 60 it spans ranks 22-39.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any


@dataclass(frozen=True)
class Spread:
    """Median and spread of one quantity over rounds."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    rounds: int
    ci_low: float
    """The median's 95 % confidence interval (:func:`median_interval`)."""
    ci_high: float

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


@cache
def interval_rank(n: int, level: float = 0.95) -> int:
    """The largest j (1-based) with P(x_(j) <= median <= x_(n+1-j)) >= ``level`` for n independent values of any
    continuous distribution: that probability is 1 - 2 P(B <= j - 1), B ~ Binomial(n, 1/2). 1 (min-max) when no
    pair reaches ``level`` (n <= 5 at 95 %)."""
    j, tail = 1, 0.0  # tail = P(B <= j - 1)
    while j < (n + 1) // 2:
        tail += math.comb(n, j - 1) / 2**n
        if 1 - 2 * (tail + math.comb(n, j) / 2**n) < level:
            break
        j += 1
    return j


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``level`` confidence interval for the median of ``values``' distribution: the order
    statistics x_(j), x_(n+1-j) (:func:`interval_rank`). It assumes the rounds are independent draws, which the
    balanced order and per-round ratios approximate (drift cancels within a round)."""
    ordered = sorted(values)
    j = interval_rank(len(ordered), level)
    return ordered[j - 1], ordered[len(ordered) - j]


def spread(values: list[float]) -> Spread:
    """Median, min, max, quartiles (inclusive method: q1/q3 lie within the values) and the median's 95 %
    interval."""
    if not values:
        raise ValueError("spread of no values")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(statistics.median(values), min(values), max(values), q1, q3, len(values), *median_interval(values))


def round_times(blocks: list[list[float]]) -> list[float]:
    """Per round: the median step time of the variant's block."""
    return [statistics.median(block) for block in blocks]


def per_round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Round-by-round ratio of two variants' round times."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} rounds against {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


REFERENCE = "ddp_no_sync"
"""The variant whose trained parameters the others are compared with after a launch (where it ran:
:func:`benchmarks.interleave.reference_of`); also what a stored launch without a ``param_reference`` compared with."""

RATIOS: tuple[tuple[str, str, str], ...] = (
    ("distaccum / no_sync", "distaccum", "ddp_no_sync"),
    ("Accelerate / no_sync", "accelerate", "ddp_no_sync"),
    ("distaccum / floor", "distaccum", "compute_floor"),
    ("no_sync / floor", "ddp_no_sync", "compute_floor"),
    ("every_micro / no_sync", "ddp_every_micro", "ddp_no_sync"),
    ("ledger on / off", "distaccum", "distaccum_no_ledger"),
    ("fingerprint on / off", "distaccum", "distaccum_no_fingerprint"),
    ("checks on / off", "distaccum", "distaccum_no_checks"),
    ("checks off: distaccum / no_sync", "distaccum_no_checks", "ddp_no_sync"),
    ("grad_norm on / off", "distaccum_grad_norm", "distaccum"),
    ("compiled: distaccum / hand-written", "distaccum_compiled", "ddp_no_sync_compiled"),
    ("compiled / eager (hand-written)", "ddp_no_sync_compiled", "ddp_no_sync"),
    ("bf16 reduce: distaccum / hook", "distaccum_bf16_reduce", "ddp_bf16_hook"),
    ("Python hook / C++ hook (hand-written)", "ddp_python_hook", "ddp_no_sync"),
    ("distaccum / Python hook", "distaccum", "ddp_python_hook"),
    ("Python hook: divided after / before (hand-written)", "ddp_python_hook_after", "ddp_python_hook"),
    ("distaccum / Python hook, divided after", "distaccum", "ddp_python_hook_after"),
    ("K = 1: 1/N in the loss / folded", "distaccum_in_loss", "distaccum_folded_k1"),
    ("records: synchronous / a step late", "distaccum_sync_records", "distaccum"),
    ("data: DataLoader / in-process rows", "distaccum_loader", "distaccum"),
    ("data: copied rows / views", "distaccum_copied_rows", "distaccum"),
    ("window: gloo / sockets", "distaccum_gloo_window", "distaccum"),
    ("window over gloo: distaccum / no_sync", "distaccum_gloo_window", "ddp_no_sync"),
    ("A/A: no_sync twin / no_sync", "ddp_no_sync_twin", "ddp_no_sync"),
    ("A/A compiled: twin / hand-written", "ddp_no_sync_compiled_twin", "ddp_no_sync_compiled"),
    ("compiled hand-written: static / dynamic shapes", "ddp_no_sync_compiled_static", "ddp_no_sync_compiled"),
)
"""(label, numerator, denominator): the issue's four ratios first, then the others (each only when both
variants ran)."""
ISSUE_RATIOS = tuple(label for label, *_ in RATIOS[:4])


def target(label: str, case: str, k: int) -> float | None:
    """The issues' target for a ratio (None: no target): distaccum / no_sync <= 1.02 everywhere, and the same
    for the bf16-compressed reduction against the hand-written compressing hook and for compiled distaccum against
    the hand-written compiled loop (issue 21's "no fixed cost", eager and compiled);
    distaccum / floor <= 1.08 at K=16 on the 27.3M-parameter case."""
    if label in ("distaccum / no_sync", "bf16 reduce: distaccum / hook", "compiled: distaccum / hand-written"):
        return 1.02
    if label == "distaccum / floor" and case.startswith("27.3M") and k == 16:
        return 1.08
    return None


def verdict(s: Spread, goal: float | None) -> str:
    """'met' when the median's 95 % interval lies within the target, 'missed' when it lies beyond it, otherwise
    'within the spread' (not resolved: more rounds narrow the interval). Up to 19 rounds the interval holds the
    IQR (min-max at 8), so it is never looser than the quartile rule it replaced there; beyond, it narrows with
    the rounds, which the IQR does not, so a long enough run can resolve a target the quartiles never could."""
    if goal is None:
        return ""
    if s.ci_high <= goal:
        return "met"
    if s.ci_low > goal:
        return "missed"
    return "within the spread"


def ratios_of(rounds: dict[str, list[float]], case: str, k: int) -> dict[str, Any]:
    """Every ratio of :data:`RATIOS` whose two variants ran, from their round times: the spread of the per-round
    ratios, the rounds' ratios themselves, the target and the verdict."""
    ratios: dict[str, Any] = {}
    for label, num, den in RATIOS:
        if num in rounds and den in rounds:
            values = per_round_ratios(rounds[num], rounds[den])
            s = spread(values)
            goal = target(label, case, k)
            ratios[label] = {**s.as_dict(), "per_round": values, "target": goal, "verdict": verdict(s, goal)}
    return ratios


def summarize_launch(record: dict[str, Any]) -> dict[str, Any]:
    """One timing launch's rows: per-variant round times and every ratio whose variants ran."""
    spec = record["spec"]
    rounds = {name: round_times(blocks) for name, blocks in record["step_s"].items()}
    variants = {name: {"round_s": times, "step_s": spread(times).as_dict()} for name, times in rounds.items()}
    ratios = ratios_of(rounds, spec["case"], spec["accum_steps"])
    return {"case": spec["case"], "k": spec["accum_steps"], "micro_batch": spec["micro_batch"],
            "steps_per_block": spec["steps"], "rounds": len(record["orders"]), "variants": variants, "ratios": ratios,
            "orders": record["orders"], "param_rel_diff": record["param_rel_diff"],
            "param_reference": record.get("param_reference", REFERENCE),
            "distaccum_ledger": record.get("distaccum_ledger", {}), "busbw": record.get("busbw")}


MIN_LAUNCHES = 6
"""Launches a verdict across launches needs: the fewest whose min-max holds the median with 95 % (97 %)."""


def across_launches(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, K and ratio measured in at least two launches (``benchmarks.run --repeat``): each launch's median
    as one value, their median, min-max and the verdict from them (:func:`verdict`; the interval of up to 8
    launches is their min-max, whose confidence is 1 - 2 / 2^launches: 97 % for 6). Fewer than
    :data:`MIN_LAUNCHES` launches give no verdict: their min-max holds the median with less than 95 %. Beside it,
    ``pooled``: every launch's rounds as one sample (its interval is the narrower, and is right only when the
    launches share no effect of their own: information, not the verdict).

    Why launches, not rounds: a launch's processes keep their CPU placement, memory layout and allocator state for
    all its rounds, so an interval from one launch's rounds holds only if launches share no effect of their own,
    which one launch cannot show; the launches' medians are independent whether or not they do. Several launches
    can show it: :func:`launch_effect` compares the spread of their means with what their rounds' noise gives."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("status", "ok") == "ok":
            groups.setdefault((row["case"], row["k"]), []).append(row)
    out = []
    for (case, k), launches in groups.items():
        if len(launches) < 2:
            continue
        for label, _, _ in RATIOS:
            medians = [launch["ratios"][label]["median"] for launch in launches if label in launch["ratios"]]
            if len(medians) == len(launches):
                s = spread(medians)
                goal = target(label, case, k)
                judged = verdict(s, goal) if len(medians) >= MIN_LAUNCHES or goal is None else "too few launches"
                per_launch = [launch["ratios"][label]["per_round"] for launch in launches]
                pooled = spread([x for rounds in per_launch for x in rounds])
                out.append({"case": case, "k": k, "ratio": label, "launch_medians": medians, **s.as_dict(),
                            "target": goal, "verdict": judged, "pooled": pooled.as_dict(),
                            **launch_effect(per_launch)})
    return out


def launch_effect(per_launch: list[list[float]]) -> dict[str, float]:
    """Whether launches carry an effect of their own, from every launch's per-round ratios (logs): ``launch_sd``,
    the spread of the launches' mean log ratios, against ``expected_sd``, what the rounds' own spread inside a
    launch gives a mean of that many rounds (the root of the mean within-launch variance over the rounds per
    launch). Alike (``launch_sd / expected_sd`` near 1, an F statistic's root): the launches differ by their
    rounds' noise only, and one launch's rounds are a sample as good as the same number spread over launches;
    well above 1: each launch moves the ratio by itself, and only launches' medians can judge it. NaN with fewer
    than two launches of two rounds each."""
    usable = [[math.log(x) for x in rounds] for rounds in per_launch if len(rounds) >= 2 and min(rounds) > 0]
    if len(usable) < 2:
        return {"launch_sd": math.nan, "expected_sd": math.nan}
    means = [statistics.fmean(rounds) for rounds in usable]
    within = statistics.fmean(statistics.variance(rounds) / len(rounds) for rounds in usable)
    return {"launch_sd": statistics.stdev(means), "expected_sd": math.sqrt(within)}


def finite(value: Any) -> bool:
    """A real, finite number."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
