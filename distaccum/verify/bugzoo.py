"""The bug zoo: known gradient-accumulation bugs injected into real runs, and what catches each one.

Every bug is a fault that wraps a real object of a real run (:mod:`distaccum.testing.zoo`,
:mod:`distaccum.testing.faults`), installed in the launched workers through the run's loss component
(:class:`distaccum.testing.Inject`), exactly as the tests inject faults. Each bug runs once through the
Python verify API (:func:`distaccum.verify.runner.config_job` / :func:`~distaccum.verify.runner.run_verify`:
the plain reference against one candidate split on 2 ranks through the launcher), and that candidate is
a real training run with the runtime checks on: the reduction fingerprint, the non-finite policy, the
warnings (its tripwire runs every step, as verify sets it; training's default is every 10 steps). Bugs
with the same configuration share one reference run.

Each bug declares the cause it must be diagnosed as (:data:`distaccum.verify.diagnosis.CAUSES`); a row
says whether it was caught, by what and at which step, the diagnosis given (verify's first finding, which
reads the runtime checks' reports too) and whether it is the declared one. Control rows (no bug) must not
be caught. :func:`run_zoo` returns the rows; :func:`render` draws the table; ``bugzoo.json`` holds both.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from distaccum import testing
from distaccum.cluster.local import LaunchPlan, launch
from distaccum.config import RunConfig, from_mapping, to_mapping
from distaccum.rundir import CONSOLE_LOG, SEED, read_json, read_metrics, read_warnings, write_json
from distaccum.split import Split
from distaccum.verify.console import EXIT_FAIL, EXIT_OK, output_to, timed_run
from distaccum.verify.runner import (
    VerifyJob,
    VerifyResult,
    candidate_config,
    config_job,
    run_verify,
)
from distaccum.verify.tripwire import read_divergence

ZOO_FILE = "bugzoo.json"
SPLIT = Split(2, 4, 2)
"""Every candidate: world 2, micro-batch 2 x 4 accumulation steps (global batch 16)."""
STEPS = 3
"""Optimizer steps per run: 40 samples in windows of 16, so step 3 is a partial window of 8."""

GPT_LOSS = {"_target_": "distaccum.losses.token_cross_entropy", "_partial_": True}
GPT: dict[str, Any] = {
    "model": {"_target_": "distaccum.models.TinyGPT", "width": 32, "depth": 1, "heads": 4, "max_len": 32},
    "data": {
        "dataset": {
            "_target_": "distaccum.datasets.CorpusSequences",
            "num_samples": 40,
            "seq_min": 4,
            "seq_max": 24,
        },
        "collate": {"_target_": "distaccum.datasets.pad_collate", "_partial_": True},
    },
    "loss": GPT_LOSS,
}
CONFIGS: dict[str, dict[str, Any]] = {
    # tiny_gpt: variable-length sequences (micro-batches hold different numbers of loss items), fp32.
    "gpt": GPT,
    "gpt_fp16": {**GPT, "precision": "fp16"},
    "gpt_dropout": {**GPT, "model": {**GPT["model"], "dropout": 0.1}},
    "convnet_bn": {
        "model": {"_target_": "distaccum.models.ConvNetBN", "width": 8, "depth": 2, "classes": 4},
        "data": {
            "dataset": {"_target_": "distaccum.datasets.SyntheticImages", "num_samples": 40, "classes": 4}
        },
        "loss": {"_target_": "distaccum.losses.sample_cross_entropy", "_partial_": True},
    },
}
"""The configurations bugs run on (each has one reference run); engine and faults come per bug."""


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


BUGS: tuple[Bug, ...] = (
    Bug(
        "loss_div_k",
        "loss/K with variable-length items",
        "each micro-batch's loss is its mean over its own items, the window the mean of the K x W micro-batch means",
        "gpt",
        (fault("MeanPerMicroBatch"),),
        "loss_normalization",
    ),
    Bug(
        "mean_per_micro_batch",
        "the mean-per-micro-batch normalisation",
        "each micro-batch's summed loss divided by its samples (a per-sample mean), the window by K x W",
        "gpt",
        (fault("PerSampleMean"),),
        "loss_normalization",
    ),
    Bug(
        "no_sync_wrong_micro",
        "no_sync on the wrong micro-batch",
        "the window's reduction runs with micro-batch K-1, not K: the last micro-batch's gradient is never reduced",
        "gpt",
        (fault("NoSyncOffByOne"),),
        "rank_divergence",
        note="one missing reduction; one extra reduction is harmless under DDP's averaging hook",
    ),
    Bug(
        "skipped_reduction",
        "a rank that skips the reduction",
        "rank 1 takes part in the all-reduce but keeps its own local gradient",
        "gpt",
        (fault("SkipReduction", "faults", rank=1),),
        "rank_divergence",
    ),
    Bug(
        "static_graph_no_sync",
        "static_graph=True with no_sync",
        "a real DDP(static_graph=True) driven by the loop's no_sync accumulation (pytorch#187732)",
        "gpt",
        (fault("StaticGraph"),),
        "known_error",
        note="torch 2.13 still has the bug: it asserts on the first no_sync backward (the silent half follows "
        "only once that assert is fixed)",
    ),
    Bug(
        "deepspeed_double_scaling",
        "loss scaled twice (DeepSpeed)",
        "engine.backward(loss) with DeepSpeed's default scale_wrt_gas=True: the loss divided by K once more",
        "gpt",
        (fault("DeepSpeedScaleWrtGas"),),
        "gradient_scale",
        {"name": "deepspeed", "zero_stage": 1},
    ),
    Bug(
        "partial_window_by_k",
        "partial window scaled by K",
        "the partial last window (8 of 16 samples) normalised as if it held the full window's items",
        "gpt",
        (fault("NominalPartialCount", "faults"),),
        "partial_window",
    ),
    Bug(
        "scheduler_per_micro",
        "scheduler stepped per micro-batch",
        "the learning-rate schedule stepped K times per optimizer step",
        "gpt",
        (fault("SchedulerPerMicroBatch", times=SPLIT.accum_steps),),
        "lr_schedule",
    ),
    Bug(
        "clip_per_micro",
        "clipping per micro-batch",
        "clip_grad_norm_(1.0) after every micro-batch's backward, on the partial accumulation",
        "gpt",
        (fault("ClipPerMicroBatch", max_norm=1.0),),
        "clipping",
    ),
    Bug(
        "gradscaler_per_micro",
        "GradScaler updated per micro-batch",
        "scaler.update() after every micro-batch's backward (fp16, DDP on CPU: torch's GradScaler and autocast)",
        "gpt_fp16",
        (fault("ScalerUpdatePerMicroBatch"),),
        "known_error",
        note="GradScaler refuses update() without unscale_()/step() since the last one: the bug fails loudly",
    ),
    Bug(
        "grads_not_zeroed",
        "gradients not zeroed between windows",
        "the optimizer's zero_grad never runs: each window starts from the previous step's gradient",
        "gpt",
        (fault("GradientsNotZeroed"),),
        "stale_gradients",
    ),
    Bug(
        "grads_wiped_mid_window",
        "gradients wiped mid-window",
        "zero_grad() before micro-batch 3 of 4 (a re-initialisation, NeMo Automodel #3530)",
        "gpt",
        (fault("GradientsWipedMidWindow", before=3),),
        "lost_gradients",
    ),
    Bug(
        "batchnorm_per_micro",
        "BatchNorm statistics per micro-batch",
        "model convnet_bn (BatchNorm) accumulated over 4 micro-batches of 2: statistics of 2 samples, not 16",
        "convnet_bn",
        (),
        "batch_statistics",
    ),
    Bug(
        "dropout_rng_shared",
        "dropout RNG shared across ranks",
        "every rank re-seeds with the same seed before each micro-batch: the same dropout masks on every rank",
        "gpt_dropout",
        (fault("SharedDropoutSeed"),),
        "shared_rng",
    ),
    Bug(
        "same_samples",
        "every rank reading the same samples",
        "every rank's source serves rank 0's micro-batches (a sampler that ignores the rank)",
        "gpt",
        (fault("SameSamples"),),
        "shared_data",
    ),
    Bug("control", "control: no bug", "the base configuration as it is", "gpt", control=True),
    Bug(
        "control_dropout",
        "control: dropout, ranks seeded apart",
        "dropout 0.1 without a bug: verify fails (the split changes the masks), no runtime check may fire",
        "gpt_dropout",
        (),
        "randomness",
        control=True,
        note="verify cannot tell shared from independent masks; only the runtime check can",
    ),
)
"""The zoo: every bug the issue lists, then the controls."""


def run_config(bug: Bug, run_dir: Path, seed: Path | None) -> RunConfig:
    """The bug's configuration: its base, its engine, its faults wrapped around the loss, the zoo's split."""
    base = CONFIGS[bug.config]
    loss = (
        {"_target_": "distaccum.testing.Inject", "component": base["loss"], "faults": list(bug.faults)}
        if bug.faults
        else base["loss"]
    )
    return from_mapping(
        {
            **base,
            "loss": loss,
            "engine": bug.engine,
            "run_dir": str(run_dir),
            "accum": {"micro_batch": SPLIT.micro_batch, "steps": SPLIT.accum_steps},
            "trainer": {
                "nproc": SPLIT.world_size,
                "max_steps": STEPS,
                "device": "cpu",
                "init_from": str(seed) if seed else None,
                # a bug that desynchronized the ranks' collectives fails, not hangs
                "collective_timeout_s": 120.0,
            },
            "log": {"console": "quiet"},
        }
    )


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


ZOO_LOG = "zoo-worker.log"
"""A candidate's console output in the zoo's shared launch (verify copies it into ``console.log``)."""
ZOO_STATUS = "zoo-status.json"
"""A candidate's exit code (1 when any rank raised) and wall time in the zoo's shared launch."""


def zoo_worker(plan_file: Path) -> None:
    """One rank of the zoo's launch: every bug's candidate, one after the other, each a fresh
    :class:`~distaccum.trainer.Trainer` on the launched process group (as the CLI's worker runs one), its
    faults installed when its components are built and removed after it. A run that raises (the
    fingerprint, a crash the bug causes) raises on every rank at the same point; the ranks then agree on
    its exit code and go on with the next."""
    import torch
    import torch.distributed as dist

    from distaccum.cluster.procgroup import ensure_process_group
    from distaccum.cluster.topology import DistEnv
    from distaccum.preflight import instantiate_components
    from distaccum.trainer import Trainer

    ensure_process_group(DistEnv.from_environ(os.environ), torch.device("cpu"))
    for values in json.loads(plan_file.read_text()):
        cfg = from_mapping(values)
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        started, code = time.perf_counter(), EXIT_OK
        with output_to(run_dir / ZOO_LOG, append=True):
            try:
                parts = instantiate_components(cfg)
                Trainer.of(cfg, parts, check_components=False).fit()
            except Exception:  # noqa: BLE001 - the bug's failure is this run's result, reported like a worker's
                traceback.print_exc()
                code = EXIT_FAIL
            finally:
                testing.uninstall()
        codes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(codes, code)  # every rank finished this run before the next starts
        if dist.get_rank() == 0:
            write_json(
                run_dir / ZOO_STATUS, {"exit_code": max(codes), "seconds": time.perf_counter() - started}
            )


def run_candidates(root: Path, configs: list[RunConfig]) -> int:
    """Every candidate in ONE 2-rank launch (``python -m distaccum _bugzoo_worker PLAN``): process start-up,
    not the tiny runs, dominates the zoo's time. Returns the launch's exit code."""
    plan = root / "zoo-plan.json"
    plan.write_text(json.dumps([to_mapping(c) for c in configs], indent=2) + "\n")
    launch_plan = LaunchPlan(
        nnodes=1,
        nproc=SPLIT.world_size,
        rdzv_endpoint="127.0.0.1:0",
        rdzv_id="bugzoo",
        max_restarts=0,
        run_dir=str(root),
    )
    with output_to(root / ZOO_LOG, append=True):
        return launch(launch_plan, ["-m", "distaccum", "_bugzoo_worker", str(plan)])


def already_ran(run_dir: Path) -> int:
    """A candidate the shared launch ran: its output goes to verify's console log, its exit code back."""
    log = run_dir / ZOO_LOG
    sys.stdout.write(log.read_text(errors="replace") if log.is_file() else "")
    status = read_json(run_dir / ZOO_STATUS)
    return int(status.get("exit_code", EXIT_FAIL))


def run_zoo(root: Path, bugs: Sequence[Bug] = BUGS, *, echo: Callable[[str], None] = print) -> list[Row]:
    """Run every bug under ``root``: one reference per configuration (in this process), every candidate
    in one launch, then one verify (:func:`~distaccum.verify.runner.run_verify`) per bug; write
    ``root/bugzoo.json`` and return the rows."""
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny runs: one thread per worker (as verify does)
    references: dict[str, tuple[Path, tuple[int, float]]] = {}
    jobs: list[tuple[Bug, VerifyJob, Path, Path]] = []
    for bug in bugs:
        if bug.config not in references:
            ref_root = root / "references" / bug.config
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                job = config_job(run_config(Bug("reference", "", "", bug.config), ref_root, None), [SPLIT])
            ran = timed_run(
                functools.partial(job.reference, ref_root / "reference"), ref_root / "reference" / CONSOLE_LOG
            )
            testing.uninstall()
            references[bug.config] = (ref_root, ran)
            echo(f"  reference {bug.config}: exit {ran[0]} ({ran[1]:.1f} s)")
        ref_root, ran = references[bug.config]
        bug_dir = root / bug.name
        shutil.rmtree(bug_dir, ignore_errors=True)
        bug_dir.mkdir(parents=True)
        (bug_dir / "reference").symlink_to(ref_root / "reference", target_is_directory=True)
        cfg = run_config(bug, bug_dir, ref_root / SEED)
        try:
            with warnings.catch_warnings():  # its warnings (batch statistics) are the candidate's to report
                warnings.simplefilter("ignore")
                job = config_job(cfg, [SPLIT])  # pre-flight checks it here, before anything is launched
        finally:
            testing.uninstall()  # its components installed its faults in this process: not ours to keep
        jobs.append(
            (
                bug,
                replace(job, reference_ran=ran, candidate=lambda split, d: already_ran(d)),
                bug_dir,
                ref_root / SEED,
            )
        )
    started = time.perf_counter()
    code = run_candidates(
        root,
        [candidate_config(job.cfg, SPLIT, bug_dir / SPLIT.label(), seed) for _, job, bug_dir, seed in jobs],
    )
    echo(f"  {len(jobs)} candidate runs in one launch (exit {code}, {time.perf_counter() - started:.0f} s)")
    rows: list[Row] = []
    for bug, job, bug_dir, _ in jobs:
        result = run_verify(job, bug_dir, echo=lambda line: None)
        testing.uninstall()
        seconds = float(read_json(bug_dir / SPLIT.label() / ZOO_STATUS).get("seconds", 0.0))
        rows.append(row_of(bug, result, seconds))
        row = rows[-1]
        echo(
            f"  {bug.name}: {'caught' if row.caught else 'NOT caught'} by {'; '.join(row.caught_by) or '-'}; "
            f"diagnosis {row.diagnosis} ({'right' if row.diagnosis_correct else 'WRONG'}) ({row.seconds:.1f} s)"
        )
    (root / ZOO_FILE).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return rows


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
