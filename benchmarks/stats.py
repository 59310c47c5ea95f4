"""From block step times to per-round ratios, their medians, intervals and verdicts.

A round's time of a variant is the median of its block's step times (a stray slow step, a garbage collection, does
not move it). A ratio is taken *per round*, between two blocks that ran moments apart in the same processes, so
slow drift of the machine cancels in it; the reported figure is the median of the per-round ratios with its 95 %
confidence interval (:func:`median_interval`, distribution-free: two order statistics), which narrows as rounds are
added, beside the interquartile range, which only says how far single rounds scatter. A target is met when the
interval lies within it, missed when it lies beyond it, otherwise not resolved (:func:`verdict`).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

from benchmarks.variants import EXPERT


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
    return Spread(
        statistics.median(values), min(values), max(values), q1, q3, len(values), *median_interval(values)
    )


def round_times(blocks: list[list[float]]) -> list[float]:
    """Per round: the median step time of the variant's block."""
    return [statistics.median(block) for block in blocks]


def per_round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Round-by-round ratio of two variants' round times."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} rounds against {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


COMPILED_EXPERTS = ("ddp_no_sync_compiled", "ddp_no_sync_compiled_static")
"""The compiled expert loop with ``dynamic=True`` and with specialised shapes: compiled distaccum is judged against
whichever of them ran faster in the launch (the lower median round time)."""
FASTER_COMPILED = "faster compiled expert"
"""The denominator of the compiled ratio: :func:`faster_compiled_expert`."""
DISTACCUM_VS_EXPERT = "distaccum / expert"
COMPILED = "compiled distaccum / compiled expert"
RATIOS: tuple[tuple[str, str, str], ...] = (
    (DISTACCUM_VS_EXPERT, "distaccum", EXPERT),
    ("distaccum / floor", "distaccum", "compute_floor"),
    ("expert / floor", EXPERT, "compute_floor"),
    (COMPILED, "distaccum_compiled", FASTER_COMPILED),
    ("A/A: expert twin / expert", "ddp_no_sync_twin", EXPERT),
    ("A/A compiled: twin / compiled expert", "ddp_no_sync_compiled_twin", "ddp_no_sync_compiled"),
    ("compiled expert: static / dynamic shapes", "ddp_no_sync_compiled_static", "ddp_no_sync_compiled"),
    ("Accelerate / expert", "accelerate", EXPERT),
    ("every_micro / expert", "ddp_every_micro", EXPERT),
    ("ledger on / off", "distaccum", "distaccum_no_ledger"),
    ("fingerprint on / off", "distaccum", "distaccum_no_fingerprint"),
    ("checks on / off", "distaccum", "distaccum_no_checks"),
    ("grad_norm on / off", "distaccum_grad_norm", "distaccum"),
    ("bf16 reduce: distaccum / hook", "distaccum_bf16_reduce", "ddp_bf16_hook"),
    ("records: synchronous / a step late", "distaccum_sync_records", "distaccum"),
)
"""(label, numerator, denominator): every ratio a launch reports when both of its variants ran."""
TARGET = 1.02
"""Issue 21's "no fixed cost": distaccum within 2 % of the expert loop, eager and compiled."""
GUARD = 1.05
"""The CPU regression guard: the median of distaccum / expert at most this at every split, read from one run."""


def target(label: str) -> float | None:
    """A ratio's target (None: none): :data:`TARGET` for distaccum against the expert loop, eager, compiled and with
    the bf16-compressed reduction against the hand-written compressing hook."""
    return TARGET if label in (DISTACCUM_VS_EXPERT, COMPILED, "bf16 reduce: distaccum / hook") else None


def verdict(s: Spread, goal: float | None) -> str:
    """'met' when the median's 95 % interval lies within the target, 'missed' when it lies beyond it, otherwise
    'not resolved' (within the spread: more rounds narrow the interval)."""
    if goal is None:
        return ""
    if s.ci_high <= goal:
        return "met"
    if s.ci_low > goal:
        return "missed"
    return "not resolved"


def faster_compiled_expert(rounds: dict[str, list[float]]) -> str | None:
    """Of the compiled expert loops that ran, the one with the lower median round time (None: neither ran)."""
    ran = [name for name in COMPILED_EXPERTS if name in rounds]
    return min(ran, key=lambda name: statistics.median(rounds[name]), default=None)


def ratios_of(rounds: dict[str, list[float]]) -> dict[str, Any]:
    """Every ratio of :data:`RATIOS` whose two variants ran, from their round times: the spread of the per-round
    ratios, the rounds' ratios themselves, the denominator, the target and the verdict."""
    ratios: dict[str, Any] = {}
    for label, num, den in RATIOS:
        den = (faster_compiled_expert(rounds) or den) if den == FASTER_COMPILED else den
        if num in rounds and den in rounds:
            values = per_round_ratios(rounds[num], rounds[den])
            s = spread(values)
            goal = target(label)
            ratios[label] = {
                **s.as_dict(),
                "per_round": values,
                "denominator": den,
                "target": goal,
                "verdict": verdict(s, goal),
            }
    return ratios


def summarize_launch(record: dict[str, Any]) -> dict[str, Any]:
    """One timing launch's row: per-variant round times and every ratio whose variants ran."""
    spec = record["spec"]
    rounds = {name: round_times(blocks) for name, blocks in record["step_s"].items()}
    return {
        "case": spec["case"],
        "k": spec["accum_steps"],
        "micro_batch": spec["micro_batch"],
        "steps_per_block": spec["steps"],
        "rounds": len(record["orders"]),
        "variants": {
            name: {"round_s": times, "step_s": spread(times).as_dict()} for name, times in rounds.items()
        },
        "ratios": ratios_of(rounds),
        "orders": record["orders"],
        "param_rel_diff": record["param_rel_diff"],
        "param_reference": record.get("param_reference"),
    }


def guard(timing: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The CPU regression guard over a run's splits: met when the median of distaccum / expert is at most
    :data:`GUARD` at every split, with the worst split (None: the ratio was not measured)."""
    rows = [
        (row["ratios"][DISTACCUM_VS_EXPERT]["median"], row["case"], row["k"])
        for row in timing
        if DISTACCUM_VS_EXPERT in row.get("ratios", {})
    ]
    if not rows:
        return None
    worst, case, k = max(rows)
    return {"bound": GUARD, "met": worst <= GUARD, "worst": worst, "case": case, "k": k, "splits": len(rows)}
