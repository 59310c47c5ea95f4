"""``distaccum verify``: run the plain single-process reference and each candidate split, compare, explain.

Two ways in, one comparison:

- a config (``distaccum verify [overrides]``): components are instantiated here, the reference
  (:mod:`distaccum.verify.reference`) runs in this process, candidates through the real launcher;
- a script (``distaccum verify --script FILE [--nproc N] [-- ARGS]``): the user's own ``Trainer``
  script is run once as the reference (one process) and once per candidate under the launcher,
  told what to be through ``DISTACCUM_VERIFY``.

Each run gets a sub-directory of run_dir (its console output in ``console.log``); the library's
reports (:mod:`distaccum.verify`, :mod:`distaccum.verify.diagnosis`) become a table, ``verify.json`` and an
exit code: 0 all candidates match, 1 a mismatch or failed run, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from distaccum.cli.compose import to_run_config
from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.preflight import preflight
from distaccum.config import ConfigError, RunConfig, Split, from_mapping, to_mapping, with_overrides
from distaccum.rundir import CONFIG, CONSOLE_LOG, LAUNCH_CONFIG, SEED, read_json
from distaccum.verify.compare import (
    Report,
    RunData,
    Tolerances,
    candidate_config,
    candidate_splits,
    compare,
    reference_config,
    reproducible,
    tolerance_for,
    write_seed_checkpoint,
)
from distaccum.verify.diagnosis import Finding, RunFacts, diagnose, model_facts, step_facts, unequal_items

VERIFY_FILE = "verify.json"


@dataclass
class Launched:
    """One finished run: its split, exit code, wall time and what it wrote."""

    split: Split
    engine: str
    exit_code: int
    seconds: float
    data: RunData


@contextmanager
def console_to(path: Path) -> Iterator[None]:
    """Send this process's (and its children's) stdout/stderr to ``path``: the table stays readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    env_before = dict(os.environ)
    # Verify runs are tiny: one intra-op thread per worker. Two threads on a loaded 2-core machine
    # made the world-1 reference 3-10x slower (spinning OpenMP workers); a user's setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with open(path, "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        os.environ.clear()
        os.environ.update(env_before)


def _log_tail(run_dir: Path, lines: int = 15) -> str:
    path = run_dir / CONSOLE_LOG
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
    s = run.split
    return {"engine": run.engine, "world_size": s.world_size, "micro_batch": s.micro_batch,
            "accum_steps": s.accum_steps, "run_dir": str(run.data.run_dir), "exit_code": run.exit_code,
            "seconds": round(run.seconds, 2)}


def _print_table(rows: list[tuple[Launched, Report, list[Finding]]]) -> None:
    head = (f"  {'split':<12}{'engine':<11}{'world':>5}{'micro':>6}{'accum':>6}  {'max_abs':>8}{'max_rel':>9}"
            f"{'loss_diff':>10}  {'first divergence':<30}{'result':<7}{'time':>6}")
    print("\n" + head)
    print("  " + "-" * (len(head) - 2))
    for run, report, _ in rows:
        s = run.split
        print(f"  {s.label():<12}{run.engine:<11}{s.world_size:>5}{s.micro_batch:>6}"
              f"{s.accum_steps:>6}  {_num(report.max_abs_diff):>8}{_num(report.max_rel_diff):>9}"
              f"{_num(report.max_loss_diff):>10}  {_where(report)[:29]:<30}"
              f"{'PASS' if report.passed else 'FAIL':<7}{run.seconds:>5.1f}s")
    for run, report, findings in rows:
        if report.passed:
            continue
        print(f"\n  {run.split.label()} FAILED: {_where(report)}")
        d = report.first_divergence
        if d is not None and d.reference is not None:
            print(f"    reference {d.reference:.9g}, candidate {d.candidate:.9g}, |diff| {d.abs_diff:.3g}")
        for note in report.notes:
            print(f"    note: {note}")
        for finding in findings:
            print(f"    diagnosis [{finding.cause}]: {finding.message}")
        if run.exit_code and report.first_divergence and report.first_divergence.quantity != "ranks":
            print(f"    last lines of {run.data.run_dir}/{CONSOLE_LOG}:\n{_log_tail(run.data.run_dir)}")


@dataclass
class Plan:
    """One verify: what to run and how. ``reference(run_dir)`` and ``candidate(split, run_dir)``
    return exit codes; both write their files into ``run_dir``."""

    cfg: RunConfig
    """The configuration verified (global batch, precision, steps, tolerances)."""
    splits: list[Split]
    reference: Callable[[Path], int]
    candidate: Callable[[Split, Path], int]
    facts: Callable[[], RunFacts]
    what: str
    """The model, as named in the header."""
    reference_ran: tuple[int, float] | None = None
    """(exit code, seconds) when the reference already ran into run_dir/reference."""


def _timed(run: Callable[[], int], log: Path) -> tuple[int, float]:
    start = time.perf_counter()
    with console_to(log):
        try:
            code = run()
        except Exception:  # noqa: BLE001 - an in-process reference that raised is a failed run
            import traceback

            traceback.print_exc()
            code = EXIT_FAIL
    return code, time.perf_counter() - start


def run_verify(plan: Plan, root: Path) -> int:
    """Run the reference and every candidate, compare, diagnose, print, write verify.json."""
    cfg = plan.cfg
    root.mkdir(parents=True, exist_ok=True)
    tol: Tolerances = tolerance_for(cfg)
    global_batch = cfg.split(cfg.trainer.nproc).global_batch
    print(f"distaccum verify: {plan.what}, {cfg.engine.name}, {cfg.precision}, global batch {global_batch}, "
          f"{cfg.trainer.max_steps} optimizer steps, {len(plan.splits)} candidate split(s)")
    print(f"  reference: plain PyTorch in one process, the whole window ({global_batch} samples) in one "
          f"forward/backward, {'fp64' if cfg.verify.reference_dtype == 'fp64' else cfg.precision}, the same seed "
          "checkpoint, samples, optimizer and schedule")
    print(f"  tolerance ({cfg.precision}): loss, grad_norm at every step: |cand - ref| <= {tol.steps}; "
          f"final parameters: {tol.params}", flush=True)
    started = time.perf_counter()
    ref_dir = root / "reference"
    code, seconds = plan.reference_ran or _timed(lambda: plan.reference(ref_dir), ref_dir / CONSOLE_LOG)
    ref = Launched(Split(global_batch, 1, 1), "plain", code, seconds, RunData.load(ref_dir))
    print(f"  reference: {len(ref.data.records)} steps ({seconds:.1f} s)", flush=True)
    summary: dict[str, Any] = {
        "passed": False, "model": plan.what, "precision": cfg.precision,
        "reference_dtype": cfg.verify.reference_dtype, "global_batch": global_batch,
        "steps": cfg.trainer.max_steps,
        "tolerance": {"steps": asdict(tol.steps), "params": asdict(tol.params),
                      "criterion": "max|cand - ref| <= atol + rtol * max|ref|, per scalar or tensor"},
        "reference": {**_describe(ref), "precision": "fp64" if cfg.verify.reference_dtype == "fp64" else cfg.precision},
        "reference_reproducible": None, "candidates": [],
    }
    if code or len(ref.data.records) < cfg.trainer.max_steps or ref.data.params is None:
        print(f"distaccum verify: the reference run failed (exit {code}); last lines of "
              f"{ref_dir}/{CONSOLE_LOG}:\n{_log_tail(ref_dir)}", file=sys.stderr)
        (root / VERIFY_FILE).write_text(json.dumps(_finite(summary), indent=2) + "\n")
        return EXIT_FAIL

    runs: list[tuple[Launched, Report]] = []
    for split in plan.splits:
        run_dir = root / split.label()
        code, seconds = _timed(lambda s=split, d=run_dir: plan.candidate(s, d), run_dir / CONSOLE_LOG)
        cand = Launched(split, cfg.engine.name, code, seconds, RunData.load(run_dir))
        runs.append((cand, compare(ref.data, cand.data, tol)))
        print(f"  {split.label()}: {'pass' if runs[-1][1].passed else 'FAIL'} ({seconds:.1f} s)", flush=True)

    facts = plan.facts()

    def explain(run: Launched, report: Report) -> list[Finding]:
        if report.passed:
            return []
        steps = step_facts(report, ref.data.records, run.data.records, tol.steps.rtol)
        return diagnose(report, facts, run.split, unequal_items(run.data.records), run.exit_code, steps)

    if any([f.cause for f in explain(run, report)] == ["unexplained"] for run, report in runs):
        # Only then pay for a second reference run: is the reference itself reproducible?
        again_dir = root / "reference-rerun"
        again_code, again_s = _timed(lambda: plan.reference(again_dir), again_dir / CONSOLE_LOG)
        same = again_code == 0 and reproducible(ref.data, RunData.load(again_dir))
        facts = replace(facts, reference_reproducible=same)
        summary["reference_reproducible"] = same
        print(f"  reference rerun: {'bitwise identical' if same else 'DIFFERS'} ({again_s:.1f} s)", flush=True)

    rows: list[tuple[Launched, Report, list[Finding]]] = []
    for run, report in runs:
        findings = explain(run, report)
        rows.append((run, report, findings))
        summary["candidates"].append({"split": run.split.label(), **_describe(run), **report.to_dict(),
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


# --- a config ---------------------------------------------------------------------------------------

def config_plan(cfg: RunConfig, splits: list[Split]) -> Plan:
    """Verify ``cfg``: components instantiated (and pre-flight checked) here, reference in-process."""
    from distaccum.cluster.local import launch_local
    from distaccum.verify.reference import run_reference

    checked = preflight(cfg)
    root = Path(cfg.run_dir)
    seed = Path(cfg.trainer.init_from) if cfg.trainer.init_from else root / SEED
    if not cfg.trainer.init_from:
        write_seed_checkpoint(cfg, checked.components, seed)
    global_batch = cfg.split(cfg.trainer.nproc).global_batch

    def reference(run_dir: Path) -> int:
        import torch

        # console_to's OMP_NUM_THREADS reaches the launched candidates, not this process: torch read
        # the variable when it was imported. Apply it here too (2 threads on a loaded 2-core machine
        # made the in-process reference 4-9x slower than 1; measured on the hf_causal_lm default).
        threads = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads))
        try:
            run_reference(reference_config(cfg, run_dir, seed), checked.components, run_dir,
                          global_batch=global_batch)
        finally:
            torch.set_num_threads(threads)
        return EXIT_OK

    def candidate(split: Split, run_dir: Path) -> int:
        cand = candidate_config(cfg, split, run_dir, seed)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir / LAUNCH_CONFIG
        config_file.write_text(json.dumps(to_mapping(cand), indent=2) + "\n")
        return launch_local(cand, config_file)

    return Plan(cfg, splits, reference, candidate, lambda: model_facts(checked.model, cfg.accum.loss_norm),
                checked.components.describe()["model"])


def verify_task(dcfg: Any) -> int:
    """The Hydra task behind ``distaccum verify``; exits 2 on bad input, 1 on a mismatch."""
    try:
        cfg = to_run_config(dcfg)
        plan = config_plan(cfg, candidate_splits(cfg))
    except ValueError as err:
        print(f"distaccum: invalid configuration: {err}", file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None
    code = run_verify(plan, Path(cfg.run_dir))
    if code:
        raise SystemExit(code)
    return code


# --- a script ---------------------------------------------------------------------------------------

def script_plan(script: Path, args: list[str], nproc: int, root: Path, auto: bool) -> Plan:
    """Verify a user script that trains with ``distaccum.Trainer``.

    The reference run goes first (one process): its Trainer writes the resolved config, from which
    the candidate splits follow (the script's own split on ``nproc`` ranks, plus others with
    ``auto``).
    """
    from distaccum.cluster.local import LaunchPlan, launch
    from distaccum.trainer import VERIFY_ENV

    seed = root / SEED
    command = [str(script), *args]

    def reference(run_dir: Path) -> int:
        request = {"mode": "reference", "run_dir": str(run_dir), "seed_out": str(seed), "world_size": nproc}
        env = {**os.environ, VERIFY_ENV: json.dumps(request)}
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(var, None)
        return subprocess.run([sys.executable, *command], env=env, check=False).returncode

    def candidate(split: Split, run_dir: Path) -> int:
        request = {"mode": "candidate", "run_dir": str(run_dir), "init_from": str(seed),
                   "micro_batch": split.micro_batch, "accum_steps": split.accum_steps}
        plan = LaunchPlan(1, split.world_size, "127.0.0.1:0", "distaccum-verify", 0, str(run_dir))
        return launch(plan, command, {VERIFY_ENV: json.dumps(request)})

    ref_dir = root / "reference"
    code, seconds = _timed(lambda: reference(ref_dir), ref_dir / CONSOLE_LOG)
    resolved = read_json(ref_dir / CONFIG)
    if code or not resolved:
        raise ConfigError(f"the script {script} failed as the verify reference (exit {code}); last lines of "
                          f"{ref_dir}/{CONSOLE_LOG}:\n{_log_tail(ref_dir)}")
    resolved.pop("components", None)
    cfg = with_overrides(from_mapping(resolved), {"trainer.nproc": nproc, "trainer.nnodes": 1,
                                                  "verify.splits": "auto" if auto else "config",
                                                  "run_dir": str(root)})
    summary = read_json(ref_dir / "summary.json")
    facts = RunFacts(tuple(summary.get("batch_stat_layers", ())), tuple(summary.get("random_layers", ())),
                     cfg.accum.loss_norm)
    return Plan(cfg, candidate_splits(cfg), reference, candidate, lambda: facts, str(summary.get("model", script)),
                reference_ran=(code, seconds))


def script_main(argv: list[str]) -> int:
    """``distaccum verify --script FILE [--nproc N] [--auto] [--run-dir DIR] [-- ARGS]``."""
    parser = argparse.ArgumentParser(
        prog="distaccum verify --script",
        description="Verify a script that trains with distaccum.Trainer: run it as a single-process reference "
                    "and as candidate splits under the launcher, and compare them step by step.")
    parser.add_argument("--script", type=Path, required=True, help="the Python script (its Trainer is verified)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks of the candidate run (default 2)")
    parser.add_argument("--auto", action="store_true", help="also try other splits of the same global batch")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="where the runs and verify.json go (default runs/verify-<script>-<time>)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")
    try:
        opts = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and EXIT_CONFIG
    if not opts.script.is_file():
        print(f"distaccum: --script {opts.script}: no such file", file=sys.stderr)
        return EXIT_CONFIG
    if opts.nproc < 1:
        print(f"distaccum: --nproc must be >= 1, got {opts.nproc}", file=sys.stderr)
        return EXIT_CONFIG
    args = opts.args[1:] if opts.args[:1] == ["--"] else opts.args
    root = opts.run_dir or Path("runs") / f"verify-{opts.script.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        plan = script_plan(opts.script.resolve(), args, opts.nproc, root, opts.auto)
    except ValueError as err:
        print(f"distaccum: {err}", file=sys.stderr)
        return EXIT_CONFIG
    return run_verify(plan, root)


def verify_main(argv: list[str], run_hydra: Callable[[Callable[[Any], int]], None]) -> int:
    """``distaccum verify``: a script (``--script``) or a config (Hydra overrides)."""
    if any(a == "--script" or a.startswith("--script=") for a in argv):
        return script_main(argv)
    run_hydra(verify_task)
    return EXIT_OK
