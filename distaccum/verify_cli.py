"""``distaccum verify``: launch a single-process reference and each candidate split, compare, explain.

Entry layer only: it validates the config, launches runs through the real launcher one after the
other (each in a sub-directory of run_dir, its console output in ``console.log`` there), and turns
the library's reports (:mod:`distaccum.verify`, :mod:`distaccum.diagnosis`) into a table,
``verify.json`` and an exit code: 0 all candidates match, 1 a mismatch or failed run, 2 bad config.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from distaccum.cli import EXIT_CONFIG, EXIT_FAIL, EXIT_OK, to_run_config
from distaccum.config import RunConfig, Split, to_mapping
from distaccum.diagnosis import Finding, diagnose, model_facts, unequal_items
from distaccum.verify import (
    SEED_FILE,
    Report,
    RunData,
    Tolerances,
    candidate_config,
    candidate_splits,
    compare,
    reference_config,
    reproducible,
    split_label,
    tolerance_for,
    write_seed_checkpoint,
)

VERIFY_FILE = "verify.json"


@dataclass
class Launched:
    """One finished run: its config, exit code, wall time and what it wrote."""

    cfg: RunConfig
    exit_code: int
    seconds: float
    data: RunData


def _launch(cfg: RunConfig) -> Launched:
    """Run ``cfg`` through the real launcher into a fresh run_dir, console output to console.log."""
    from distaccum.launcher import launch_local

    run_dir = Path(cfg.run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config_file = run_dir / "launch_config.json"
    config_file.write_text(json.dumps(to_mapping(cfg), indent=2) + "\n")
    env_before = dict(os.environ)  # the launcher sets e.g. OMP_NUM_THREADS per world size
    # Verify runs are tiny: one intra-op thread per worker. Two threads on a loaded 2-core machine
    # made the world-1 reference 3-10x slower (spinning OpenMP workers); a user's setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    start = time.perf_counter()
    try:
        with open(run_dir / "console.log", "w") as log:
            # workers inherit fds 1 and 2: their output lands in the file, the table stays readable
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            code = launch_local(cfg, config_file)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.environ.clear()
        os.environ.update(env_before)
    return Launched(cfg, code, time.perf_counter() - start, RunData.load(run_dir))


def _log_tail(run_dir: Path, lines: int = 15) -> str:
    path = run_dir / "console.log"
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join("    | " + line for line in text[-lines:])


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2e}"


def _finite(value: Any) -> Any:
    """JSON without NaN/Infinity (not valid JSON): non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _where(report: Report) -> str:
    d = report.first_divergence
    if d is None:
        return "-"
    what = {"ranks": "ranks differ", "missing": "run stopped"}.get(d.quantity, d.quantity)
    return f"step {d.step}: {what}; {d.parameter}" if d.parameter else f"step {d.step}: {what}"


def _describe(run: Launched) -> dict[str, Any]:
    split = run.cfg.split()
    return {"engine": run.cfg.engine.name, "precision": run.cfg.precision, "world_size": split.world_size,
            "micro_batch": split.micro_batch, "accum_steps": split.accum_steps,
            "run_dir": run.cfg.run_dir, "exit_code": run.exit_code, "seconds": round(run.seconds, 2)}


def _print_header(cfg: RunConfig, ref: RunConfig, tol: Tolerances, candidates: list[Split]) -> None:
    split = ref.split()
    print(f"distaccum verify: {cfg.model.name}, {cfg.engine.name}, {cfg.precision}, global batch "
          f"{split.global_batch}, {cfg.trainer.max_steps} optimizer steps, {len(candidates)} candidate split(s)")
    print(f"  reference: 1 process, micro_batch {split.micro_batch} x 1 step ({ref.engine.name}, "
          f"{ref.precision}), same seed checkpoint and samples per step")
    print(f"  tolerance ({cfg.precision}): loss, grad_norm at every step: |cand - ref| <= {tol.steps}")
    print(f"  {'':<{len(cfg.precision) + 14}}every parameter tensor at the end: max|cand - ref| <= {tol.params}",
          flush=True)


def _print_table(rows: list[tuple[Launched, Report, list[Finding]]]) -> None:
    head = (f"  {'split':<12}{'engine':<11}{'world':>5}{'micro':>6}{'accum':>6}  {'max_abs':>8}{'max_rel':>9}"
            f"{'loss_diff':>10}  {'first divergence':<30}{'result':<7}{'time':>6}")
    print("\n" + head)
    print("  " + "-" * (len(head) - 2))
    for run, report, _ in rows:
        s = run.cfg.split()
        print(f"  {split_label(s):<12}{run.cfg.engine.name:<11}{s.world_size:>5}{s.micro_batch:>6}"
              f"{s.accum_steps:>6}  {_num(report.max_abs_diff):>8}{_num(report.max_rel_diff):>9}"
              f"{_num(report.max_loss_diff):>10}  {_where(report)[:29]:<30}"
              f"{'PASS' if report.passed else 'FAIL':<7}{run.seconds:>5.1f}s")
    for run, report, findings in rows:
        if report.passed:
            continue
        print(f"\n  {split_label(run.cfg.split())} FAILED: {_where(report)}")
        d = report.first_divergence
        if d is not None and d.reference is not None:
            print(f"    reference {d.reference:.9g}, candidate {d.candidate:.9g}, |diff| {d.abs_diff:.3g}")
        for note in report.notes:
            print(f"    note: {note}")
        for finding in findings:
            print(f"    diagnosis [{finding.cause}]: {finding.message}")
        if run.exit_code and report.first_divergence and report.first_divergence.quantity != "ranks":
            print(f"    last lines of {run.cfg.run_dir}/console.log:\n{_log_tail(Path(run.cfg.run_dir))}")


def run_verify(cfg: RunConfig, splits: list[Split]) -> int:
    """Launch the reference and every candidate, compare, diagnose, print, write verify.json."""
    root = Path(cfg.run_dir)
    root.mkdir(parents=True, exist_ok=True)
    seed = Path(cfg.trainer.init_from) if cfg.trainer.init_from else root / SEED_FILE
    if not cfg.trainer.init_from:
        write_seed_checkpoint(cfg, seed)
    tol = tolerance_for(cfg)
    facts = model_facts(cfg)
    ref_cfg = reference_config(cfg, root / "reference", seed)
    _print_header(cfg, ref_cfg, tol, splits)
    started = time.perf_counter()

    ref = _launch(ref_cfg)
    print(f"  reference: {len(ref.data.records)} steps ({ref.seconds:.1f} s)", flush=True)
    summary: dict[str, Any] = {
        "passed": False, "model": cfg.model.name, "precision": cfg.precision,
        "reference_dtype": cfg.verify.reference_dtype, "global_batch": ref_cfg.split().global_batch,
        "steps": cfg.trainer.max_steps, "seed_checkpoint": str(seed),
        "tolerance": {"steps": asdict(tol.steps), "params": asdict(tol.params),
                      "criterion": "max|cand - ref| <= atol + rtol * max|ref|, per scalar or tensor"},
        "reference": _describe(ref), "reference_reproducible": None, "candidates": [],
    }
    if ref.exit_code or len(ref.data.records) < cfg.trainer.max_steps or ref.data.params is None:
        print(f"distaccum verify: the reference run failed (exit {ref.exit_code}); "
              f"last lines of {ref_cfg.run_dir}/console.log:\n{_log_tail(Path(ref_cfg.run_dir))}",
              file=sys.stderr)
        (root / VERIFY_FILE).write_text(json.dumps(_finite(summary), indent=2) + "\n")
        return EXIT_FAIL

    runs: list[tuple[Launched, Report]] = []
    for split in splits:
        cand = _launch(candidate_config(cfg, split, root / split_label(split), seed))
        runs.append((cand, compare(ref.data, cand.data, tol)))
        print(f"  {split_label(split)}: {'pass' if runs[-1][1].passed else 'FAIL'} ({cand.seconds:.1f} s)",
              flush=True)

    def explain(run: Launched, report: Report) -> list[Finding]:
        split = run.cfg.split()
        unequal = None
        if not report.passed and facts.loss_norm == "mean_per_micro":
            unequal = unequal_items(cfg, split, cfg.trainer.max_steps)
        return diagnose(report, facts, split, unequal, run.exit_code)

    if any([f.cause for f in explain(run, report)] == ["unexplained"] for run, report in runs):
        # Only then pay for a second reference run: is the reference itself reproducible?
        again = _launch(replace(ref_cfg, run_dir=str(root / "reference-rerun")))
        facts = replace(facts, reference_reproducible=again.exit_code == 0 and reproducible(ref.data, again.data))
        summary["reference_reproducible"] = facts.reference_reproducible
        print(f"  reference rerun: {'bitwise identical' if facts.reference_reproducible else 'DIFFERS'} "
              f"({again.seconds:.1f} s)", flush=True)

    rows: list[tuple[Launched, Report, list[Finding]]] = []
    for run, report in runs:
        split = run.cfg.split()
        findings = explain(run, report)
        rows.append((run, report, findings))
        summary["candidates"].append({
            "split": split_label(split), **_describe(run), **report.to_dict(),
            "diagnosis": [f.to_dict() for f in findings]})
    summary["passed"] = all(report.passed for _, report, _ in rows)
    summary["seconds"] = round(time.perf_counter() - started, 2)
    _print_table(rows)
    (root / VERIFY_FILE).write_text(json.dumps(_finite(summary), indent=2) + "\n")
    verdict = "PASSED" if summary["passed"] else "FAILED"
    passed = sum(report.passed for _, report, _ in rows)
    print(f"\nverify {verdict}: {passed}/{len(rows)} split(s) match the single-process reference "
          f"({summary['seconds']:.0f} s) -> {root / VERIFY_FILE}", flush=True)
    return EXIT_OK if summary["passed"] else EXIT_FAIL


def verify_task(dcfg: Any) -> int:
    """The Hydra task behind ``distaccum verify``; exits 2 on bad config, 1 on a mismatch."""
    try:
        cfg = to_run_config(dcfg)
        splits = candidate_splits(cfg)
    except ValueError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    code = run_verify(cfg, splits)
    if code:
        raise SystemExit(code)
    return code
