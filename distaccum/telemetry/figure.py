"""The report's figure (``report.png``), drawn from what :mod:`distaccum.telemetry.report` computed:
the median step per run, the loss curves, their agreement (two runs or more) and the gradient noise
scale. matplotlib is imported here only, inside the functions: the report's tables need none of it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from distaccum.telemetry.report import Agreement, Row, rel_diff
from distaccum.units import human_bytes

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_report(
    rows: list[Row],
    curves: dict[str, dict[int, float]],
    agreements: list[Agreement],
    path: Path,
    rtol: float,
    eval_curves: dict[str, dict[int, float]] | None = None,
    gns: dict[str, dict[int, tuple[float, float]]] | None = None,
) -> None:
    """Write :func:`report_figure` to ``path`` (``report.png``)."""
    fig = report_figure(rows, curves, agreements, rtol, eval_curves, gns)
    import matplotlib.pyplot as plt  # after report_figure has chosen the Agg backend

    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_figure(
    rows: list[Row],
    curves: dict[str, dict[int, float]],
    agreements: list[Agreement],
    rtol: float,
    eval_curves: dict[str, dict[int, float]] | None = None,
    gns: dict[str, dict[int, tuple[float, float]]] | None = None,
) -> Figure:
    """The report's figure: per run, the median step split into compute / exposed comm / data /
    optimizer; the loss curves overlaid, disagreeing runs dashed, held-out eval losses as crosses;
    with two or more loss curves, each compared run's relative loss difference to its reference against
    ``rtol`` (one run has nothing to compare: no panel); with ``gns`` (step -> raw, smoothed noise scale
    per run) a last panel of the gradient noise scale."""
    import matplotlib

    matplotlib.use("Agg")  # no display; also safe when called from a worker or CI
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    flagged = {a.label for a in agreements if not a.ok}
    shown = [r for r in rows if r.steps > 0]
    noise = {label: series for label, series in (gns or {}).items() if series}
    compared = sum(1 for curve in curves.values() if curve) >= 2
    panels = 2 + compared + bool(noise)
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, max(4.5, 1.5 + 0.45 * len(rows))))
    bars, losses = axes[:2]
    labels = [f"{r.label} {r.split}" if r.split != "-" else r.label for r in shown]
    left = [0.0] * len(shown)
    parts = (
        ("compute_s", "compute (fwd+bwd)", "tab:blue"),
        ("comm_exposed_s", "exposed communication", "tab:red"),
        ("data_s", "data", "tab:gray"),
        ("optim_s", "optimizer", "tab:green"),
    )
    for key, name, color in parts:
        widths = [0.0 if math.isnan(getattr(r, key)) else getattr(r, key) for r in shown]
        bars.barh(labels, widths, left=left, label=name, color=color)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    for y, row in enumerate(shown):
        outer = "" if math.isnan(row.outer_bytes) else f", {human_bytes(row.outer_bytes)}/step across islands"
        if not math.isnan(row.comm_share):
            bars.text(left[y], y, f" {row.comm_share:.0%} comm{outer}", va="center", fontsize=8)
    bars.invert_yaxis()
    bars.set_xlim(0, 1.2 * max(left, default=0.0) or 1.0)  # room for the share labels
    bars.set_xlabel("median seconds per optimizer step")
    skipped = [f"{r.label} ({r.status})" for r in rows if r.steps == 0]
    bars.set_title(
        "median step: compute vs exposed communication"
        + ("\nnot run: " + ", ".join(skipped) if skipped else ""),
        fontsize=10,
    )
    bars.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8)
    for label, curve in curves.items():
        if not curve:
            continue
        steps = sorted(curve)
        bad = label in flagged
        losses.plot(
            steps,
            [curve[s] for s in steps],
            linestyle="--" if bad else "-",
            marker=".",
            label=label + (" (disagrees)" if bad else ""),
            alpha=0.85,
        )
    for label, curve in (eval_curves or {}).items():
        if curve:
            steps = sorted(curve)
            losses.plot(steps, [curve[s] for s in steps], linestyle=":", marker="x", label=f"{label} eval")
    losses.set_xlabel("optimizer step")
    losses.set_ylabel("loss")
    losses.set_title(
        "loss curves (x: held-out eval)" if any((eval_curves or {}).values()) else "loss curves", fontsize=10
    )
    losses.xaxis.set_major_locator(MaxNLocator(integer=True))
    if curves or eval_curves:
        losses.legend(fontsize=8)
    if compared:
        diffs = axes[2]
        for a in agreements:
            cand, ref = curves[a.label], curves[a.reference]
            steps = sorted(cand.keys() & ref.keys())
            # identical losses have no place on a log axis: draw them at 1e-17 (below fp64 resolution)
            values = [max(rel_diff(cand[s], ref[s]), 1e-17) for s in steps]
            diffs.plot(
                steps,
                values,
                linestyle="-" if a.ok else "--",
                marker=".",
                label=f"{a.label} vs {a.reference}",
            )
        diffs.axhline(rtol, color="black", linewidth=1, linestyle=":", label=f"rtol {rtol:g}")
        diffs.set_yscale("log")
        diffs.set_xlabel("optimizer step")
        diffs.set_ylabel("|loss - reference| / |reference|")
        diffs.set_title("loss agreement" if agreements else "loss agreement: no comparable runs", fontsize=10)
        diffs.xaxis.set_major_locator(MaxNLocator(integer=True))
        diffs.legend(fontsize=8)
    if noise:
        ax = axes[-1]
        for label, series in noise.items():
            steps = sorted(series)
            line = ax.plot(steps, [series[s][1] for s in steps], label=f"{label} (smoothed)")[0]
            ax.plot(
                steps,
                [series[s][0] for s in steps],
                linestyle="none",
                marker=".",
                alpha=0.3,
                color=line.get_color(),
            )
        ax.set_yscale("symlog")  # raw per-step estimates can be negative
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("B_simple (loss items)")
        ax.set_title("gradient noise scale: smoothed (line), per step (dots)", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
