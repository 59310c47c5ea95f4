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
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from distaccum.batching.adaptive import VERIFY_RECIPE
from distaccum.cluster.local import launch_local
from distaccum.components import Components, ModelRecipe
from distaccum.config import ConfigError, RunConfig, from_mapping, to_mapping, valid_splits
from distaccum.engines import engine_class
from distaccum.outer.simulate import run_outer_reference
from distaccum.preflight import preflight
from distaccum.resolve import resolve_sync
from distaccum.rundir import CONSOLE_LOG, LAUNCH_CONFIG, SEED
from distaccum.rundir.weights import save_weights
from distaccum.runtime.topology import resolve_replicas
from distaccum.split import Split
from distaccum.verify.compare import (
    UNIT_ROUNDOFF,
    Report,
    RunData,
    Tolerances,
    compare,
    reduction_roundings,
    reproducible,
    tolerance_for,
    with_reduction,
)
from distaccum.verify.console import EXIT_FAIL, EXIT_OK, log_tail, timed_run
from distaccum.verify.diagnosis import (
    Finding,
    RunFacts,
    StepFacts,
    diagnose,
    model_facts,
    step_facts,
    unequal_items,
)
from distaccum.verify.outer_merge import outer_merge_fact
from distaccum.verify.reference import ramp_of, run_reference
from distaccum.verify.replay import Replayed, combinations, micro_gradients

VERIFY_FILE = "verify.json"
Launcher = Callable[[RunConfig, Path], int]
"""Starts a candidate's workers on its config (also written to the given file) and waits: an exit code. The local
launcher (:func:`~distaccum.cluster.local.launch_local`) by default; Ray Train's for ``distaccum verify --to ray``."""
# --- which runs to launch (pure) ------------------------------------------------------------------


def candidate_splits(cfg: RunConfig) -> list[Split]:
    """The configured split, plus with ``verify.splits=auto`` other splits of the same global batch.

    World sizes go up to ``trainer.nproc`` (one node; with ``engine.replicas=R``, multiples of R). The reference's own split (world 1, one
    micro-batch) is never a candidate. Extra candidates alternate between world sizes (largest
    first) and between most and least accumulation, so a small bound still covers the extremes.
    """
    configured = cfg.split(cfg.trainer.nproc)
    chosen = [configured]
    if cfg.verify.splits == "auto" and not cfg.outer.enabled:  # outer-synced: the islands depend on the split
        lanes: list[list[Split]] = []
        replicas = cfg.engine.replicas if cfg.engine.replicas != "auto" else 1
        for world in range(cfg.trainer.nproc, 0, -1):
            if world % int(replicas):  # HSDP: R replicas need a world they divide
                continue
            options = sorted(valid_splits(configured.global_batch, world), key=lambda s: -s.accum_steps)
            options = [s for s in options if s.accum_steps * s.world_size > 1 and s != configured]
            # most accumulation, least, then inwards
            lanes.append(
                [options[i // 2] if i % 2 == 0 else options[-1 - i // 2] for i in range(len(options))]
            )
        while any(lanes) and len(chosen) < cfg.verify.max_candidates:
            for lane in lanes:
                if lane and len(chosen) < cfg.verify.max_candidates:
                    chosen.append(lane.pop(0))
    return chosen


def parse_split(label: str) -> Split:
    """``w2-m4-k4`` (world size, micro-batch, accumulation steps) -> a :class:`Split`."""
    try:
        world, micro, accum = (int(part[1:]) for part in label.split("-"))
        if min(world, micro, accum) < 1 or label != Split(micro, accum, world).label():
            raise ValueError(label)
    except ValueError:
        raise ValueError(
            f"split {label!r} is not of the form w<world>-m<micro_batch>-k<accum_steps>, e.g. w2-m4-k4"
        ) from None
    return Split(micro, accum, world)


def _with_split(cfg: RunConfig, split: Split, run_dir: Path, seed: Path | None) -> RunConfig:
    return replace(
        cfg,
        accum=replace(
            cfg.accum,
            micro_batch=split.micro_batch,
            steps=split.accum_steps,
            global_batch=split.global_batch
            if cfg.accum.ramp.enabled
            else None,  # a ramp ends at the global batch
        ),
        trainer=replace(
            cfg.trainer,
            nproc=split.world_size,
            nnodes=1,
            check_every=1,
            init_from=str(seed) if seed else None,
            max_restarts=0,
            resume=False,
        ),
        log=replace(cfg.log, console="quiet", wandb=False, grad_norm=True),  # compared every step
        verify=replace(cfg.verify, record=True),
        run_dir=str(run_dir),
    )


def reference_config(cfg: RunConfig, run_dir: Path, seed: Path) -> RunConfig:
    """The configuration the plain reference (:mod:`distaccum.verify.reference`) runs with: one process, the
    seed checkpoint, fp64 when ``verify.reference_dtype=fp64``. Its global batch is the candidates'."""
    ref = _with_split(cfg, Split(cfg.split(cfg.trainer.nproc).global_batch, 1, 1), run_dir, seed)
    return replace(ref, precision="fp64" if cfg.verify.reference_dtype == "fp64" else cfg.precision)


def candidate_config(cfg: RunConfig, split: Split, run_dir: Path, seed: Path) -> RunConfig:
    """``cfg`` with ``split``, the seed checkpoint, the tripwire on every step, and recording on."""
    return _with_split(cfg, split, run_dir, seed)


def write_seed_checkpoint(recipe: ModelRecipe, parts: Components, path: Path) -> None:
    """Build the model exactly as a worker does (same seed, fp32 or fp64; no ``init_from``: this file is
    what the runs start from) and save its weights."""
    save_weights(replace(recipe, init_from=None).build(parts).state_dict(), path)


# --- running ----------------------------------------------------------------------------------------


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


def _finite(value: Any) -> Any:
    """JSON without NaN/Infinity (not valid JSON): non-finite floats become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
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
            f"{'PASS' if report.passed else 'FAIL':<7}{row.run.seconds:>5.1f}s"
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


def candidate_sync(cfg: RunConfig, world_size: int) -> str:
    """The sync mode a candidate of ``world_size`` ranks (on one node) runs."""
    hybrid = engine_class(cfg.engine.name).hybrid_sharding
    return resolve_sync(cfg.accum.sync, resolve_replicas(cfg.engine.replicas, hybrid, world_size, 1))


def describe_engine(cfg: RunConfig) -> str:
    """The engine for the header: its name, and for HSDP the replicas and the sync mode."""
    replicas = cfg.engine.replicas
    if replicas == "auto" or int(replicas) <= 1:
        return cfg.engine.name
    return (
        f"{cfg.engine.name} (HSDP, {replicas} replicas, accum.sync={candidate_sync(cfg, cfg.trainer.nproc)})"
    )


def verify_tolerance(cfg: RunConfig, splits: Sequence[Split]) -> tuple[Tolerances, str]:
    """The tolerances for ``cfg``'s precision, widened (:func:`~distaccum.verify.compare.with_reduction`) for a
    compressed reduction (``accum.reduce_dtype``) by the most roundings any candidate split makes, unless
    ``verify.rtol``/``verify.atol`` are given; and a note for the header."""
    tol = tolerance_for(cfg.precision, cfg.verify)
    if cfg.accum.reduce_dtype == "fp32" or cfg.verify.rtol is not None or cfg.verify.atol is not None:
        return tol, ""
    n = max(
        reduction_roundings(candidate_sync(cfg, s.world_size), s.world_size, s.accum_steps) for s in splits
    )
    lr = cfg.optim.lr * cfg.optim.lr_scale(cfg.global_batch(cfg.trainer.nproc))
    adam = cfg.optim.betas if cfg.optim.name == "adamw" else None
    widened = with_reduction(
        tol, cfg.accum.reduce_dtype, n, lr=lr, steps=cfg.trainer.max_steps, adam_betas=adam
    )
    e = n * UNIT_ROUNDOFF[cfg.accum.reduce_dtype]
    return widened, (
        f", gradients reduced in {cfg.accum.reduce_dtype}: + e = {n} roundings x "
        f"{UNIT_ROUNDOFF[cfg.accum.reduce_dtype]:.3g} = {e:.3g} relative on grad_norm and loss, "
        + (
            "+ 2 k lr T on parameters (AdamW moves an element at most k lr per step)"
            if adam
            else "+ 2 e relative on parameters"
        )
    )


def run_verify(job: VerifyJob, root: Path, *, echo: Callable[[str], None] = print) -> VerifyResult:
    """Run the reference and every candidate, compare, diagnose, write ``verify.json``; ``echo`` gets the
    progress lines and the table."""
    cfg = job.cfg
    root.mkdir(parents=True, exist_ok=True)
    tol, reduced = verify_tolerance(cfg, job.splits)
    global_batch = cfg.split(cfg.trainer.nproc).global_batch
    ref_precision = "fp64" if cfg.verify.reference_dtype == "fp64" else cfg.precision
    ramp = ramp_of(cfg, global_batch)
    window = (
        f"each step's global batch of accum.ramp, {', '.join(str(b) for _, b in ramp.phases)} samples"
        if ramp is not None
        else f"{global_batch} samples"
    )
    echo(
        f"distaccum verify: {job.what}, {describe_engine(cfg)}, {cfg.precision}, global batch {global_batch}, "
        f"{cfg.trainer.max_steps} optimizer steps, {len(job.splits)} candidate split(s)"
    )
    echo(
        f"  reference: {cfg.outer.method} simulated in one process, each island's samples of a step in one "
        f"forward/backward, replica after replica, then the merge, {ref_precision}, the same seed checkpoint, "
        "samples, optimizers and schedule"
        if cfg.outer.enabled
        else f"  reference: plain PyTorch in one process, the whole window ({window}) in one "
        f"forward/backward, {ref_precision}, the same seed checkpoint, samples, optimizer and schedule"
    )
    echo(
        f"  tolerance ({cfg.precision}{reduced}): loss, grad_norm at every step: |cand - ref| <= {tol.steps}; "
        f"final parameters: {tol.params}"
    )
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
        (root / VERIFY_FILE).write_text(json.dumps(_finite(summary), indent=2) + "\n")
        return VerifyResult(False, [], summary, root)

    runs: list[tuple[Launched, Report]] = []
    for split in job.splits:
        run_dir = root / split.label()
        code, seconds = timed_run(functools.partial(job.candidate, split, run_dir), run_dir / CONSOLE_LOG)
        cand = Launched(split, cfg.engine.name, code, seconds, RunData.load(run_dir))
        runs.append((cand, compare(ref.data, cand.data, tol)))
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
        if job.seed is not None and cfg.outer.enabled:
            merge = outer_merge_fact(
                cfg, run.split.world_size, job.seed, report, ref.data.checksums, run.data.checksums
            )
            steps = replace(steps, outer_merge=merge)
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
    (root / VERIFY_FILE).write_text(json.dumps(_finite(summary), indent=2) + "\n")
    verdict = "PASSED" if summary["passed"] else "FAILED"
    echo(
        f"\nverify {verdict}: {sum(row.passed for row in rows)}/{len(rows)} split(s) match the single-process "
        f"reference ({summary['seconds']:.0f} s) -> {root / VERIFY_FILE}"
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

    def reference(run_dir: Path) -> int:
        # console_to's OMP_NUM_THREADS reaches the launched candidates, not this process: torch read
        # the variable when it was imported. Apply it here too (2 threads on a loaded 2-core machine
        # made the in-process reference 4-9x slower than 1; measured on the hf_causal_lm default).
        threads = torch.get_num_threads()
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or threads))
        try:
            if cfg.outer.enabled:  # the simulator of the islands, on the split they are cut from
                run_outer_reference(
                    reference_config(cfg, run_dir, seed), checked.components, run_dir, split=splits[0]
                )
            else:
                run_reference(
                    reference_config(cfg, run_dir, seed),
                    checked.components,
                    run_dir,
                    global_batch=global_batch,
                )
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
        if cfg.outer.enabled:  # the replays know one reduction per step, not the islands' merges
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
        if cfg.outer.enabled and cfg.outer.reduce_dtype != "fp32":
            raise ValueError(
                f"outer.reduce_dtype={cfg.outer.reduce_dtype} rounds every merge, and verify has no derived bound "
                "for that rounding yet: verify the run with outer.reduce_dtype=fp32 (the same math uncompressed)"
            )
        if cfg.accum.adaptive.enabled:
            raise ValueError(VERIFY_RECIPE)
        for split in chosen:
            if split.global_batch != global_batch:
                raise ValueError(
                    f"split {split.label()} holds {split.global_batch} samples per step; the "
                    f"configuration's global batch is {global_batch}"
                )
    except ValueError as err:
        raise ConfigError(str(err)) from err
    return run_verify(config_job(cfg, chosen, launcher), Path(cfg.run_dir), echo=echo)
