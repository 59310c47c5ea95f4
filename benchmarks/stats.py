"""From block step times to per-round times, per-round ratios, medians and spreads.

A round's time of a variant is the median of its block's step times (a stray slow step, a
garbage collection, does not move it). A ratio is taken *per round*, between two blocks that ran
seconds apart in the same processes, so slow drift of the machine cancels in it; the reported
figure is the median of the per-round ratios, with its spread: min-max and the interquartile range
(IQR, the middle half of the rounds). With 8 rounds the IQR spans rounds 3-6 by rank.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
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

    def as_dict(self) -> dict[str, Any]:
        """JSON form."""
        return asdict(self)


def spread(values: list[float]) -> Spread:
    """Median, min, max and quartiles (inclusive method: q1/q3 lie within the values)."""
    if not values:
        raise ValueError("spread of no values")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return Spread(statistics.median(values), min(values), max(values), q1, q3, len(values))


def round_times(blocks: list[list[float]]) -> list[float]:
    """Per round: the median step time of the variant's block."""
    return [statistics.median(block) for block in blocks]


def per_round_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """Round-by-round ratio of two variants' round times."""
    if len(numerator) != len(denominator):
        raise ValueError(f"{len(numerator)} rounds against {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator, strict=True)]


RATIOS: tuple[tuple[str, str, str], ...] = (
    ("distaccum / no_sync", "distaccum", "ddp_no_sync"),
    ("Accelerate / no_sync", "accelerate", "ddp_no_sync"),
    ("distaccum / floor", "distaccum", "compute_floor"),
    ("no_sync / floor", "ddp_no_sync", "compute_floor"),
    ("every_micro / no_sync", "ddp_every_micro", "ddp_no_sync"),
    ("ledger on / off", "distaccum", "distaccum_no_ledger"),
    ("fingerprint on / off", "distaccum", "distaccum_no_fingerprint"),
    ("grad_norm on / off", "distaccum_grad_norm", "distaccum"),
    ("compiled: distaccum / hand-written", "distaccum_compiled", "ddp_no_sync_compiled"),
    ("compiled / eager (hand-written)", "ddp_no_sync_compiled", "ddp_no_sync"),
    ("bf16 reduce: distaccum / hook", "distaccum_bf16_reduce", "ddp_bf16_hook"),
    ("Python hook / C++ hook (hand-written)", "ddp_python_hook", "ddp_no_sync"),
    ("distaccum / Python hook", "distaccum", "ddp_python_hook"),
    ("K = 1: 1/N in the loss / folded", "distaccum_in_loss", "distaccum_folded_k1"),
    ("records: synchronous / a step late", "distaccum_sync_records", "distaccum"),
    ("data: DataLoader / in-process rows", "distaccum_loader", "distaccum"),
)
"""(label, numerator, denominator): the issue's four ratios first, then the others (each only when both
variants ran)."""
ISSUE_RATIOS = tuple(label for label, *_ in RATIOS[:4])


def target(label: str, case: str, k: int) -> float | None:
    """The issues' target for a ratio (None: no target): distaccum / no_sync <= 1.02 everywhere, and the same
    for the bf16-compressed reduction against the hand-written compressing hook;
    distaccum / floor <= 1.08 at K=16 on the 27.3M-parameter case."""
    if label in ("distaccum / no_sync", "bf16 reduce: distaccum / hook"):
        return 1.02
    if label == "distaccum / floor" and case.startswith("27.3M") and k == 16:
        return 1.08
    return None


def verdict(s: Spread, goal: float | None) -> str:
    """'met' when the median and the upper quartile are within the target, 'missed' when the
    median and the lower quartile are beyond it, otherwise 'within the spread' (not resolved)."""
    if goal is None:
        return ""
    if s.median <= goal and s.q3 <= goal:
        return "met"
    if s.median > goal and s.q1 > goal:
        return "missed"
    return "within the spread"


def summarize_launch(record: dict[str, Any]) -> dict[str, Any]:
    """One timing launch's rows: per-variant round times and every ratio whose variants ran."""
    spec = record["spec"]
    rounds = {name: round_times(blocks) for name, blocks in record["step_s"].items()}
    variants = {name: {"round_s": times, "step_s": spread(times).as_dict()} for name, times in rounds.items()}
    ratios: dict[str, Any] = {}
    for label, num, den in RATIOS:
        if num in rounds and den in rounds:
            values = per_round_ratios(rounds[num], rounds[den])
            s = spread(values)
            goal = target(label, spec["case"], spec["accum_steps"])
            ratios[label] = {**s.as_dict(), "per_round": values, "target": goal, "verdict": verdict(s, goal)}
    return {"case": spec["case"], "k": spec["accum_steps"], "micro_batch": spec["micro_batch"],
            "steps_per_block": spec["steps"], "rounds": spec["rounds"], "variants": variants, "ratios": ratios,
            "orders": record["orders"], "param_rel_diff": record["param_rel_diff"],
            "distaccum_ledger": record.get("distaccum_ledger", {}), "busbw": record.get("busbw")}


def finite(value: Any) -> bool:
    """A real, finite number."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
