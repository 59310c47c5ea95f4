"""Run a verification: the plain single-process reference and each candidate split, compared and explained.

The library API (also what ``distaccum verify`` runs)::

    from distaccum.verify import verify
    result = verify({"model": {"_target_": "mytask.make_model"}, "data": {"dataset": {...}},
                     "loss": {"_target_": "mytask.loss_sum"}, "accum": {"micro_batch": 2, "global_batch": 16},
                     "trainer": {"nproc": 2, "max_steps": 5}, "run_dir": "runs/check"},
                    splits=["w2-m2-k4", "w1-m4-k4"])
    result.passed, result.rows[0].report.max_rel_diff, result.rows[0].findings

Components are ``_target_`` nodes because the candidates run in worker processes started by the real
launcher (as ``distaccum train`` starts them); the reference runs in this process
(:mod:`distaccum.verify.reference`). Each run gets a sub-directory of ``run_dir`` (its console output
in ``console.log``); the comparison (:mod:`distaccum.verify.compare`) and the diagnosis
(:mod:`distaccum.verify.diagnosis`) become a :class:`VerifyResult`, a table and ``verify.json``.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from distaccum.cluster.local import launch_local
from distaccum.config import ConfigError, RunConfig, from_mapping, to_mapping
from distaccum.preflight import preflight
from distaccum.rundir import CONSOLE_LOG, LAUNCH_CONFIG, SEED
from distaccum.split import Split
from distaccum.verify.candidates import (
    candidate_config,
    candidate_splits,
    candidate_sync,
    describe_engine,
    parse_split,
    reference_config,
    verify_tolerance,
    write_seed_checkpoint,
)
from distaccum.verify.compare import Report, RunData, compare, reproducible
from distaccum.verify.console import EXIT_OK, log_tail, timed_run
from distaccum.verify.diagnosis import (
    Finding,
    RunFacts,
    StepFacts,
    diagnose,
    model_facts,
    step_facts,
    unequal_items,
)
from distaccum.verify.reference import run_reference
from distaccum.verify.replay import Replayed, combinations, micro_gradients
from distaccum.verify.result import Launched, VerifyResult, VerifyRow, json_ready, render_table
from distaccum.verify.rules import Diverged, rules_for

VERIFY_FILE = "verify.json"
Launcher = Callable[[RunConfig, Path], int]
"""Starts a candidate's workers on its config (also written to the given file) and waits: an exit code. The local
launcher (:func:`~distaccum.cluster.local.launch_local`) by default; Ray Train's for ``distaccum verify --to ray``."""


@dataclass
class VerifyJob:
    """One verify: what to run and how. ``reference(run_dir)`` and ``candidate(split, run_dir)`` return
    exit codes; both write their files into ``run_dir``."""

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
    replay: Callable[[Split], list[Replayed] | None] | None = None
    """Step 1's micro-batch gradients combined the correct way and every known wrong way, for a split
    (:mod:`distaccum.verify.replay`); None: not available (a script, a stream, random layers)."""
    seed: Path | None = None
    """The seed checkpoint every run starts from (an outer-synced run's first outer step is measured from it)."""


# --- running ----------------------------------------------------------------------------------------


def run_verify(job: VerifyJob, root: Path, *, echo: Callable[[str], None] = print) -> VerifyResult:
    """Run the reference and every candidate, compare, diagnose, write ``verify.json``; ``echo`` gets the
    progress lines and the table."""
    cfg = job.cfg
    root.mkdir(parents=True, exist_ok=True)
    tol, reduced = verify_tolerance(cfg, job.splits)
    global_batch = cfg.split(cfg.trainer.nproc).global_batch
    ref_precision = "fp64" if cfg.verify.reference_dtype == "fp64" else cfg.precision
    rules = rules_for(cfg)
    window = next((w for r in rules if (w := r.window(cfg, global_batch))), f"{global_batch} samples")
    echo(
        f"distaccum verify: {job.what}, {describe_engine(cfg)}, {cfg.precision}, global batch {global_batch}, "
        f"{cfg.trainer.max_steps} optimizer steps, {len(job.splits)} candidate split(s)"
    )
    plain = (
        f"  reference: plain PyTorch in one process, the whole window ({window}) in one "
        f"forward/backward, {ref_precision}, the same seed checkpoint, samples, optimizer and schedule"
    )
    echo(next((line for r in rules if (line := r.reference_line(cfg, ref_precision))), plain))
    tolerance = (
        f"  tolerance ({cfg.precision}{reduced}): loss, grad_norm at every step: |cand - ref| <= {tol.steps}; "
        f"final parameters: {tol.params}"
    )
    echo(next((line for r in rules if (line := r.tolerance_line(cfg))), tolerance))
    started = time.perf_counter()
    ref_dir = root / "reference"
    code, seconds = job.reference_ran or timed_run(lambda: job.reference(ref_dir), ref_dir / CONSOLE_LOG)
    ref = Launched(Split(global_batch, 1, 1), "plain", code, seconds, RunData.load(ref_dir))
    echo(f"  reference: {len(ref.data.records)} steps ({seconds:.1f} s)")
    summary: dict[str, Any] = {
        "passed": False,
        "model": job.what,
        "precision": cfg.precision,
        "reference_dtype": cfg.verify.reference_dtype,
        "global_batch": global_batch,
        "steps": cfg.trainer.max_steps,
        "tolerance": {
            "steps": asdict(tol.steps),
            "params": asdict(tol.params),
            "criterion": "max|cand - ref| <= atol + rtol * max|ref|, per scalar or tensor",
        },
        "reference": {**ref.describe(), "precision": ref_precision},
        "reference_reproducible": None,
        "candidates": [],
    }
    if code or len(ref.data.records) < cfg.trainer.max_steps or ref.data.params is None:
        echo(
            f"distaccum verify: the reference run failed (exit {code}); last lines of "
            f"{ref_dir}/{CONSOLE_LOG}:\n{log_tail(ref_dir)}"
        )
        (root / VERIFY_FILE).write_text(json.dumps(json_ready(summary), indent=2) + "\n")
        return VerifyResult(False, [], summary, root)

    runs: list[tuple[Launched, Report]] = []
    for split in job.splits:
        run_dir = root / split.label()
        code, seconds = timed_run(functools.partial(job.candidate, split, run_dir), run_dir / CONSOLE_LOG)
        cand = Launched(split, cfg.engine.name, code, seconds, RunData.load(run_dir))
        report = compare(ref.data, cand.data, tol)
        for rule in rules:  # a feature's own verdict (accum.exact: bit for bit)
            report = rule.judge(report, ref.data, cand.data)
        runs.append((cand, report))
        echo(f"  {split.label()}: {'pass' if runs[-1][1].passed else 'FAIL'} ({seconds:.1f} s)")

    facts = job.facts()
    replays: dict[str, list[Replayed] | None] = {}

    def replayed(run: Launched, steps: StepFacts) -> tuple[tuple[str, str], ...]:
        """Known wrong combinations that reproduce the candidate's step-1 gradient norm (and the correct
        one the reference's, so the replay is sound)."""
        if job.replay is None or steps.first_step_ratio is None:
            return ()
        label = run.split.label()
        if label not in replays:
            replays[label] = job.replay(run.split)
        combos = replays[label]
        if not combos:
            return ()
        cand, reference = run.data.records[0]["grad_norm"], ref.data.records[0]["grad_norm"]
        bound = tol.steps.bound(abs(reference))
        if abs(combos[0].grad_norm - reference) > bound:
            return ()
        return tuple(
            (h.cause, h.message)
            for h in combos[1:]
            if abs(h.grad_norm - cand) <= bound < abs(h.grad_norm - reference)
        )

    def explain(run: Launched, report: Report) -> list[Finding]:
        warned = tuple((str(w.get("check")), str(w.get("message"))) for w in run.data.warnings)
        if report.passed:  # only the runtime warnings can tell (the reduction count)
            return diagnose(report, facts, run.split, None, steps=StepFacts(warnings=warned))
        steps = step_facts(report, ref.data.records, run.data.records, tol.steps.rtol, run.split)
        steps = replace(steps, warnings=warned, console=run.data.console if run.exit_code else "")
        steps = replace(steps, replayed=replayed(run, steps))
        for rule in rules:
            steps = rule.explain(Diverged(cfg, run.split, job.seed, report, ref.data, run.data), steps)
        return diagnose(
            report, facts, run.split, unequal_items(run.data.records), run.exit_code, steps, tol.steps.rtol
        )

    if any([f.cause for f in explain(run, report)] == ["unexplained"] for run, report in runs):
        # Only then pay for a second reference run: is the reference itself reproducible?
        again_dir = root / "reference-rerun"
        again_code, again_s = timed_run(lambda: job.reference(again_dir), again_dir / CONSOLE_LOG)
        same = again_code == 0 and reproducible(ref.data, RunData.load(again_dir))
        facts = replace(facts, reference_reproducible=same)
        summary["reference_reproducible"] = same
        echo(f"  reference rerun: {'bitwise identical' if same else 'DIFFERS'} ({again_s:.1f} s)")

    rows = [VerifyRow(run, report, explain(run, report)) for run, report in runs]
    for row in rows:
        summary["candidates"].append(
            {
                "split": row.run.split.label(),
                **row.run.describe(),
                **row.report.to_dict(),
                "diagnosis": [f.to_dict() for f in row.findings],
            }
        )
    summary["passed"] = all(row.passed for row in rows)
    summary["seconds"] = round(time.perf_counter() - started, 2)
    echo(render_table(rows))
    (root / VERIFY_FILE).write_text(json.dumps(json_ready(summary), indent=2) + "\n")
    verdict = "PASSED" if summary["passed"] else "FAILED"
    echo(
        f"\nverify {verdict}: {sum(row.passed for row in rows)}/{len(rows)} split(s) match the single-process "
        f"reference{' bit for bit' if rows and all(r.report.bitwise for r in rows) else ''} "
        f"({summary['seconds']:.0f} s) -> {root / VERIFY_FILE}"
    )
    return VerifyResult(summary["passed"], rows, summary, root)


# --- a config -----------------------------------------------------------------------------------------


def config_job(cfg: RunConfig, splits: list[Split], launcher: Launcher = launch_local) -> VerifyJob:
    """Verify ``cfg``: components instantiated (and pre-flight checked) here, reference in-process,
    candidates through the real launcher (``launcher``)."""
    checked = preflight(cfg)
    root = Path(cfg.run_dir)
    seed = Path(cfg.trainer.init_from) if cfg.trainer.init_from else root / SEED
    if not cfg.trainer.init_from:
        write_seed_checkpoint(checked.run.model, checked.components, seed)
    global_batch = cfg.split(cfg.trainer.nproc).global_batch
    rules = rules_for(cfg)  # a feature's own reference, replays

    def reference(run_dir: Path) -> int:
        # console_to's OMP_NUM_THREADS reaches the launched candidates, not this process: torch read
        # the variable when it was imported. Apply it here too (2 threads on a loaded 2-core machine
        # made the in-process reference 4-9x slower than 1; measured on the hf_causal_lm default).
        threads = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads))
        try:
            ref = reference_config(cfg, run_dir, seed)
            if not any(r.run_reference(ref, checked.components, run_dir, splits[0]) for r in rules):
                run_reference(ref, checked.components, run_dir, global_batch=global_batch)
        finally:
            torch.set_num_threads(threads)
        return EXIT_OK

    def candidate(split: Split, run_dir: Path) -> int:
        cand = candidate_config(cfg, split, run_dir, seed)
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir / LAUNCH_CONFIG
        config_file.write_text(json.dumps(to_mapping(cand), indent=2) + "\n")
        return launcher(cand, config_file)

    def replay(split: Split) -> list[Replayed] | None:
        if not all(
            r.replays for r in rules
        ):  # e.g. outer sync's merges: the replays know one reduction per step
            return None
        grads = micro_gradients(
            checked.components,
            split,
            cfg.trainer.seed,
            seed,
            checked.components.describe()["model"],
            shuffle=cfg.data.shuffle,
            drop_last=cfg.data.drop_last,
        )
        every_micro = candidate_sync(cfg, split.world_size) == "every_micro"
        return combinations(grads, split, cfg.optim.clip_norm, every_micro) if grads is not None else None

    return VerifyJob(
        cfg,
        splits,
        reference,
        candidate,
        lambda: model_facts(checked.model, cfg.accum.loss_norm),
        checked.components.describe()["model"],
        replay=replay,
        seed=seed,
    )


def verify(
    config: RunConfig | Mapping[str, Any],
    *,
    splits: Sequence[Split | str] | None = None,
    run_dir: str | Path | None = None,
    echo: Callable[[str], None] = print,
    launcher: Launcher = launch_local,
) -> VerifyResult:
    """Verify a configuration against plain PyTorch: the single-process reference in this process, each
    candidate split on worker processes started by the launcher, as ``distaccum verify`` does.

    ``config`` is a :class:`~distaccum.config.RunConfig` or a mapping of its sections whose ``model``,
    ``data.dataset`` and ``loss`` (and optionally ``data.collate``) are ``_target_`` nodes of importable
    callables. ``splits`` are :class:`~distaccum.split.Split` objects or labels (``"w2-m4-k4"``: world size,
    micro-batch, accumulation steps) of the configured global batch; default: the configured split (with
    ``verify.splits=auto``, more). Raises :class:`~distaccum.config.ConfigError` (a ValueError) for bad input
    before anything runs; returns the :class:`VerifyResult` (``passed``, one row per split with its
    report and diagnosis), also written to ``run_dir/verify.json``. ``launcher`` starts each candidate's workers
    (:data:`Launcher`; e.g. :func:`distaccum.cluster.ray_train.launch_on_ray` runs them on Ray Train).
    """
    cfg = config if isinstance(config, RunConfig) else from_mapping(config)
    if run_dir is not None:
        cfg = replace(cfg, run_dir=str(run_dir))
    try:
        chosen = (
            [s if isinstance(s, Split) else parse_split(s) for s in splits]
            if splits
            else candidate_splits(cfg)
        )
        global_batch = cfg.global_batch(cfg.trainer.nproc)
        for rule in rules_for(cfg):  # what verify cannot take yet, in the feature's words
            rule.check(cfg)
        for split in chosen:
            if split.global_batch != global_batch:
                raise ValueError(
                    f"split {split.label()} holds {split.global_batch} samples per step; the "
                    f"configuration's global batch is {global_batch}"
                )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return run_verify(config_job(cfg, chosen, launcher), Path(cfg.run_dir), echo=echo)
