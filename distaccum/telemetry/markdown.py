"""``report.md``: the markdown ``distaccum report`` writes from what :mod:`distaccum.telemetry.report` computes.

The runs' table (one row a run), the loss-curve agreement verdict, the gradient noise scale section and why each
invalid or failed run is so. :mod:`distaccum.telemetry.figure` draws the same rows and agreements.
"""

from __future__ import annotations

import math
from statistics import median

from distaccum.telemetry.report import Agreement, Row, Run, gns_series
from distaccum.units import human_bytes


def _num(value: float, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


COLUMNS = (
    "run",
    "status",
    "overrides",
    "split (mb x K x W = G)",
    "engine",
    "sync",
    "loss norm",
    "steps",
    "effective lr",
    "samples/s",
    "compute s",
    "exposed comm s",
    "comm in flight s",
    "comm share",
    "reduced/step",
    "across replicas/step",
    "peak mem",
    "final loss",
    "eval loss (ppl)",
    "loss curve",
)


def _across(row: Row) -> str:
    """HSDP's all-reduces between replicas, or an outer sync's bytes between islands, per step."""
    if not math.isnan(row.outer_bytes):
        return f"{human_bytes(row.outer_bytes)} outer ({row.outer_syncs} syncs)"
    if row.comm_calls_replicate > 0:
        return f"{human_bytes(row.comm_bytes_replicate)} / {row.comm_calls_replicate:.0f} calls"
    return "-"


def _cells(row: Row) -> list[str]:
    valid = row.steps > 0
    return [
        f"`{row.label}`",
        row.status,
        f"`{row.varied}`" if row.varied else "",
        row.split,
        row.engine,
        row.sync,
        row.loss_norm,
        str(row.steps),
        _num(row.effective_lr, ".4g"),
        _num(row.samples_per_s, ".1f"),
        _num(row.compute_s, ".4f"),
        _num(row.comm_exposed_s, ".4f"),
        _num(row.comm_s, ".4f"),
        _num(row.comm_share, ".1%"),
        f"{human_bytes(row.comm_bytes)} / {row.comm_calls:.0f} calls"
        if valid and not math.isnan(row.comm_bytes + row.comm_calls)
        else "-",
        _across(row) if valid else "-",
        human_bytes(row.peak_mem_bytes) if valid else "-",
        _num(row.final_loss, ".5f"),
        "-"
        if math.isnan(row.eval_loss)
        else f"{row.eval_loss:.4f} ({math.exp(min(row.eval_loss, 700)):.2f})",
        row.agreement,
    ]


def render_markdown(
    rows: list[Row], agreements: list[Agreement], runs: list[Run], rtol: float, atol: float
) -> str:
    """``report.md``: the table, the agreement verdict, and why each invalid or failed run is so."""
    lines = ["# distaccum report", ""]
    counts: dict[str, int] = {}
    for row in rows:
        counts[row.status] = counts.get(row.status, 0) + 1
    how_many = f"{len(rows)} run" + ("" if len(rows) == 1 else "s")
    lines += [f"{how_many}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())), ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in rows]
    lines += [
        "",
        "Times are medians per optimizer step after warm-up, on rank 0. *exposed comm*: time "
        "the step waited on gradient communication; *comm in flight*: time any gradient "
        "collective was running, hidden or not; *comm share* = exposed / (compute + exposed). "
        "*reduced/step*: gradient collectives (for HSDP: the reduce-scatters inside each replica); "
        "*across replicas/step*: HSDP's all-reduces between replicas (the slow link across nodes), or an outer-synced "
        "run's bytes between its islands per step (a rank's, averaged over every step; `outer`, with the syncs).",
        "",
        f"## Loss-curve agreement (rtol {rtol:g}, atol {atol:g})",
        "",
    ]
    bad = [a for a in agreements if not a.ok]
    trained = sum(1 for r in runs if r.records)
    if not agreements and trained < 2:
        lines.append(
            ("One run" if trained else "No run with loss records")
            + ": nothing to compare (agreement needs two runs of the same model, data, optimizer, "
            "precision, seed and effective batch)."
        )
    elif not agreements:
        lines.append(
            "No two comparable runs (same model, data, optimizer, precision, seed and "
            "effective batch): nothing to compare."
        )
    elif not bad:
        worst = max(a.max_rel_diff for a in agreements)
        lines.append(
            f"All {len(agreements) + len({a.reference for a in agreements})} comparable runs "
            f"agree (largest relative loss difference {worst:.2e})."
        )
    else:
        lines.append(f"**{len(bad)} run(s) disagree with their reference:**")
        lines += [
            f"- `{a.label}` vs `{a.reference}`: first out of tolerance at step {a.first_bad_step}, "
            f"max relative difference {a.max_rel_diff:.2e}"
            for a in bad
        ]
    lines += render_gns(runs)
    problems = [r for r in runs if r.status not in ("ok",)]
    if problems:
        lines += ["", "## Runs that did not finish", ""]
        lines += [f"- `{r.label}`: {r.status}" + (f": {r.error}" if r.error else "") for r in problems]
    return "\n".join(lines) + "\n"


def render_gns(runs: list[Run]) -> list[str]:
    """The report.md section on the gradient noise scale (empty when no run measured it)."""
    measured = [(r, gns_series(r)) for r in runs]
    measured = [(r, series) for r, series in measured if series]
    if not measured:
        return []
    lines = [
        "",
        "## Gradient noise scale",
        "",
        "B_simple = tr(Sigma) / |G|^2 in loss items (McCandlish et al. 2018), smoothed "
        "(`gns_smoothed`, ratio of moving averages). Well below the items per step: a smaller global batch "
        "would do nearly as much per sample; well above it: larger batches still pay off.",
        "",
        "| run | items per step | gns_smoothed (last) | ratio |",
        "|---|---|---|---|",
    ]
    for run, series in measured:
        items = median(float(r.get("items", 0)) for r in run.records)
        last = series[max(series)][1]
        lines.append(
            f"| `{run.label}` | {items:.0f} | {_num(last, '.1f')} | {_num(last / items if items else math.nan, '.2f')} |"
        )
    return lines
