"""What a verification found: each run (:class:`Launched`), each candidate's row (its comparison and diagnosis), the
result (``verify.json``) and the table the command prints."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distaccum.rundir import CONSOLE_LOG
from distaccum.split import Split
from distaccum.verify.compare import Report, RunData
from distaccum.verify.console import EXIT_FAIL, EXIT_OK, log_tail
from distaccum.verify.diagnosis import Finding


@dataclass
class Launched:
    """One finished run: its split, exit code, wall time and what it wrote."""

    split: Split
    engine: str
    exit_code: int
    seconds: float
    data: RunData

    def describe(self) -> dict[str, Any]:
        """Its row of ``verify.json`` (without the comparison)."""
        s = self.split
        return {
            "engine": self.engine,
            "world_size": s.world_size,
            "micro_batch": s.micro_batch,
            "accum_steps": s.accum_steps,
            "run_dir": str(self.data.run_dir),
            "exit_code": self.exit_code,
            "seconds": round(self.seconds, 2),
        }


@dataclass
class VerifyRow:
    """One candidate split: how it ran, how it compares, and why it differs when it does."""

    run: Launched
    report: Report
    findings: list[Finding] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.report.passed


@dataclass
class VerifyResult:
    """What a verification found (``verify.json`` is :meth:`to_dict`)."""

    passed: bool
    rows: list[VerifyRow]
    summary: dict[str, Any]
    """The JSON-ready record: the header, tolerances, the reference and one entry per candidate."""
    root: Path

    @property
    def exit_code(self) -> int:
        """0 when every candidate matched the reference, 1 otherwise."""
        return EXIT_OK if self.passed else EXIT_FAIL

    def to_dict(self) -> dict[str, Any]:
        return self.summary


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"


def json_ready(value: Any) -> Any:
    """JSON without NaN/Infinity (not valid JSON): non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    return value


def where(report: Report) -> str:
    """The first divergence, in a few words."""
    d = report.first_divergence
    if d is None:
        return "-"
    what = {"ranks": "ranks differ", "missing": "run stopped"}.get(d.quantity, d.quantity)
    return f"step {d.step}: {what}; {d.parameter}" if d.parameter else f"step {d.step}: {what}"


def render_table(rows: Sequence[VerifyRow]) -> str:
    """The candidates as a table, then every failure explained."""
    head = (
        f"  {'split':<12}{'engine':<11}{'world':>5}{'micro':>6}{'accum':>6}  {'max_abs':>8}{'max_rel':>9}"
        f"{'loss_diff':>10}  {'first divergence':<30}{'result':<7}{'time':>6}"
    )
    lines = ["", head, "  " + "-" * (len(head) - 2)]
    for row in rows:
        s, report = row.run.split, row.report
        lines.append(
            f"  {s.label():<12}{row.run.engine:<11}{s.world_size:>5}{s.micro_batch:>6}"
            f"{s.accum_steps:>6}  {_num(report.max_abs_diff):>8}{_num(report.max_rel_diff):>9}"
            f"{_num(report.max_loss_diff):>10}  {where(report)[:29]:<30}"
            f"{'BITWISE' if report.bitwise else 'PASS' if report.passed else 'FAIL':<7}{row.run.seconds:>5.1f}s"
        )
    for row in rows:
        report = row.report
        if report.passed:
            lines += [f"  {row.run.split.label()} passed, but [{f.cause}]: {f.message}" for f in row.findings]
            continue
        lines += ["", f"  {row.run.split.label()} FAILED: {where(report)}"]
        d = report.first_divergence
        if d is not None and d.reference is not None:
            lines.append(
                f"    reference {d.reference:.9g}, candidate {d.candidate:.9g}, |diff| {d.abs_diff:.3g}"
            )
        lines += [f"    note: {note}" for note in report.notes]
        lines += [f"    diagnosis [{f.cause}]: {f.message}" for f in row.findings]
        if row.run.exit_code and d and d.quantity != "ranks":
            lines.append(
                f"    last lines of {row.run.data.run_dir}/{CONSOLE_LOG}:\n{log_tail(row.run.data.run_dir)}"
            )
    return "\n".join(lines)
