"""The bug zoo's rows: what a bug is (:class:`Bug`, declared before the run), what the zoo found for it
(:class:`Row`: caught, by what, at which step, the diagnosis and whether it is the declared one) and the table
(:func:`render`). :mod:`distaccum.verify.bugzoo` holds the bugs and runs them.

A row is judged from the candidate's own runtime reports (the fingerprint's or tripwire's ``divergence.json``, the
runtime warnings, the non-finite policy, distaccum's Python warnings, a crash) and from its verify result, whose
first finding is the diagnosis (verify reads the runtime reports too, and diagnoses the reduction count's warning
even when the weights agree).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distaccum.guards.tripwire import read_divergence
from distaccum.rundir import CONSOLE_LOG, read_metrics, read_warnings
from distaccum.verify.result import VerifyResult


def fault(name: str, module: str = "zoo", **kwargs: Any) -> dict[str, Any]:
    """A fault's ``_target_`` node (:mod:`distaccum.testing.zoo` or ``faults``)."""
    return {"_target_": f"distaccum.testing.{module}.{name}", **kwargs}


@dataclass(frozen=True)
class Bug:
    """One known accumulation bug (or a control without one) and how it is injected."""

    name: str
    title: str
    """As the bug is known."""
    what: str
    """What the injected fault does to the run."""
    config: str
    """Key of :data:`CONFIGS`."""
    faults: tuple[dict[str, Any], ...] = ()
    expected: str | None = None
    """The cause it must be diagnosed as (a control: verify's expected cause, None when verify must pass)."""
    engine: dict[str, Any] = field(default_factory=lambda: {"name": "ddp"})
    note: str = ""
    control: bool = False
    """No bug: no runtime check may fire and verify must say ``expected``."""


@dataclass
class Row:
    """What the zoo found for one bug (a line of ``bugzoo.json``)."""

    bug: str
    title: str
    what: str
    expected: str | None
    control: bool
    caught: bool
    caught_by: list[str]
    step: int | None
    diagnosis: str | None
    diagnosis_message: str
    diagnosis_correct: bool
    verify: dict[str, Any]
    runtime: list[dict[str, Any]]
    note: str = ""
    seconds: float = 0.0


WARNING_LINE = re.compile(r"distaccum/\S+\.py:\d+: (\w*Warning): (.*)")


def runtime_findings(run_dir: Path, exit_code: int) -> list[dict[str, Any]]:
    """What the candidate's own runtime checks reported: the fingerprint or tripwire (``divergence.json``),
    the runtime warnings, the non-finite policy, distaccum's Python warnings, and a crash."""
    found: list[dict[str, Any]] = []
    divergence = read_divergence(run_dir)
    if divergence:
        found.append(
            {
                "check": str(divergence.get("check", "tripwire")),
                "step": divergence.get("step"),
                "message": str(divergence.get("message")),
            }
        )
    for warning in read_warnings(run_dir):
        found.append(
            {
                "check": f"warning:{warning.get('check')}",
                "step": warning.get("step"),
                "message": str(warning.get("message")),
            }
        )
    records = read_metrics(run_dir)
    nonfinite = [r["step"] for r in records if r.get("nonfinite")]
    if nonfinite:
        found.append({"check": "nonfinite", "step": nonfinite[0], "message": f"non-finite steps {nonfinite}"})
    log = run_dir / CONSOLE_LOG
    text = log.read_text(errors="replace") if log.is_file() else ""
    for kind, message in dict.fromkeys(WARNING_LINE.findall(text)):
        found.append({"check": kind, "step": 0, "message": message.strip()})
    if exit_code and not divergence:
        errors = [line for line in text.splitlines() if re.match(r"^\w*(Error|Exception)\b", line)]
        found.append(
            {
                "check": "run_failed",
                "step": len(records) + 1,
                "message": errors[-1] if errors else f"exit {exit_code}",
            }
        )
    return found


CHECK_NAMES = {
    "fingerprint": "reduction fingerprint",
    "tripwire": "tripwire",
    "nonfinite": "non-finite policy",
    "warning:same_samples": "same-samples check",
    "warning:same_rng": "same-seed check",
    "warning:reduction_count": "reduction count",
}


def describe(finding: dict[str, Any]) -> str:
    """A runtime finding in a few words: which check, at which step."""
    check, step = str(finding["check"]), finding["step"]
    message = str(finding["message"])
    if check == "run_failed":
        return f"the run failed at step {step} ({short(message.split(' at ')[0], 64)})"
    if check in CHECK_NAMES:
        return f"{CHECK_NAMES[check]}, step {step}"
    return f"{check} at start ({short(message, 48)})"


def short(text: str, limit: int) -> str:
    """``text`` cut at a word boundary to about ``limit`` characters."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def row_of(bug: Bug, result: VerifyResult, seconds: float) -> Row:
    """Judge one bug's verify result and runtime reports."""
    [vrow] = result.rows or [None]  # type: ignore[list-item]
    runtime = runtime_findings(vrow.run.data.run_dir, vrow.run.exit_code) if vrow else []
    caught_by = [f"runtime: {describe(r)}" for r in runtime]
    step = min((int(r["step"]) for r in runtime if r["step"]), default=None)
    verify: dict[str, Any] = {"passed": bool(vrow and vrow.passed)}
    diagnosis, message = None, ""
    if vrow is not None and not vrow.passed:
        d = vrow.report.first_divergence
        if d is not None:
            verify.update(step=d.step, quantity=d.quantity, parameter=d.parameter)
            caught_by.append(f"verify: step {d.step} {d.quantity}")
            step = d.step if step is None else min(step, d.step)
    if vrow is not None:  # a run that matches the reference can still be diagnosed (the reduction count)
        verify["causes"] = [f.cause for f in vrow.findings]
        if vrow.findings:
            diagnosis, message = vrow.findings[0].cause, vrow.findings[0].message
    caught = bool(caught_by) if vrow is not None else False
    if vrow is None:
        caught_by = ["the reference run failed: nothing was compared"]
    correct = diagnosis == bug.expected and (not bug.control or not runtime)
    return Row(
        bug.name,
        bug.title,
        bug.what,
        bug.expected,
        bug.control,
        caught,
        caught_by,
        step,
        diagnosis,
        message,
        correct,
        verify,
        runtime,
        bug.note,
        round(seconds, 1),
    )


def render(rows: Sequence[Row]) -> str:
    """The zoo as a Markdown table (the console and the README show it)."""
    lines = ["| bug | caught | caught by | step | diagnosis | right |", "|---|---|---|---|---|---|"]
    for r in rows:
        right = "yes" if r.diagnosis_correct else "no"
        if r.control:
            right = f"{'yes' if r.diagnosis_correct else 'NO'} (control: {r.expected or 'verify passes'})"
        caught = "yes" if r.caught else ("no" if r.control else "**no**")
        lines.append(
            f"| {r.title} | {caught} | {'; '.join(r.caught_by) or '-'} | "
            f"{r.step if r.step is not None else '-'} | {r.diagnosis or '-'} | {right} |"
        )
    bugs = [r for r in rows if not r.control]
    lines.append("")
    lines.append(
        f"{sum(r.caught for r in bugs)}/{len(bugs)} bugs caught, {sum(r.diagnosis_correct for r in bugs)}"
        f"/{len(bugs)} diagnosed as their cause; controls: "
        + ", ".join(f"{r.bug} {'clean' if r.diagnosis_correct else 'FIRED'}" for r in rows if r.control)
    )
    return "\n".join(lines)
