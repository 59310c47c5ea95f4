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
be caught. :func:`run_zoo` returns the rows; :func:`render` draws the table; ``bugzoo.json`` holds both
(:mod:`distaccum.verify.zoo_rows`: the bug and row types, the judging, the table).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from distaccum import testing
from distaccum.cluster.local import LaunchRecipe, launch
from distaccum.config import RunConfig, from_mapping, to_mapping
from distaccum.rundir import CONSOLE_LOG, SEED, read_json, write_json
from distaccum.split import Split
from distaccum.verify.candidates import candidate_config
from distaccum.verify.console import EXIT_FAIL, EXIT_OK, output_to, timed_run
from distaccum.verify.runner import VerifyJob, config_job, run_verify
from distaccum.verify.zoo_rows import Bug, Row, fault, render, row_of

__all__ = ["BUGS", "CONFIGS", "Bug", "Row", "fault", "render", "row_of", "run_zoo", "zoo_worker"]

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
    "gpt_unclipped": {**GPT, "optim": {"clip_norm": None}},
    "gpt_every_micro": {**GPT, "accum": {"sync": "every_micro"}},
    # DiLoCo over 2 islands of 1 rank, the first outer step after step 2 (the closing one after step 3)
    "gpt_diloco": {**GPT, "outer": {"method": "diloco", "every": 2, "islands": 2}},
    "convnet_bn": {
        "model": {"_target_": "distaccum.models.ConvNetBN", "width": 8, "depth": 2, "classes": 4},
        "data": {
            "dataset": {"_target_": "distaccum.datasets.SyntheticImages", "num_samples": 40, "classes": 4}
        },
        "loss": {"_target_": "distaccum.losses.sample_cross_entropy", "_partial_": True},
    },
}
"""The configurations bugs run on (each has one reference run); engine and faults come per bug."""


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
    Bug(
        "no_sync_backward_only",
        "no_sync around the backward only",
        "the engine's no_sync entered around each backward, not the forward (LoongForge #163): DDP arms its "
        "reducer in the forward, so every micro-batch all-reduces",
        "gpt",
        (fault("NoSyncAroundBackward", "nosync"),),
        "reduction_count",
    ),
    Bug(
        "fsdp2_no_sync_noop",
        "a no_sync helper that does nothing under FSDP2",
        "a no_sync helper that only knows DDP (cosmos-framework #161): under FSDP2 every micro-batch reduce-scatters",
        "gpt",
        (fault("DDPOnlyNoSync", "nosync"),),
        "reduction_count",
        {"name": "fsdp"},
        note="the gradient stays right to rounding (FSDP2 sums fresh reduce-scatters): the cost, K reductions, shows, "
        "and the reduction checksum, which holds the reduced gradient to one reduction's rounding, stops the run",
    ),
    Bug(
        "nested_ddp",
        "nested DDP wrappers",
        "the first block in its own DDP, left out of the engine's (torchrec #4121): the outer no_sync does not "
        "reach it, so it all-reduces every micro-batch",
        "gpt",
        (fault("NestedDDP", "nosync"),),
        "reduction_count",
        note="the inner DDP uses the engine's counting comm hook (torch's built-in C++ all-reduce is not counted)",
    ),
    Bug(
        "sync_first_micro",
        "sync on the first micro-batch, not the last",
        "batch_idx % accum_grad == 0 as the sync condition (FunASR #3472): micro-batch 1 reduces, micro-batch K "
        "stays in no_sync",
        "gpt",
        (fault("FirstMicroSync", "nosync"),),
        "rank_divergence",
    ),
    Bug(
        "zero3_transform_per_micro",
        "an optimizer transform per micro-batch (ZeRO-3)",
        "the clip to optim.clip_norm run on the accumulated partitions after every micro-batch's reduction "
        "(ZeRO-3, accum.sync=every_micro), where DeepSpeed #8443 ran Muon's Newton-Schulz, not once at the step",
        "gpt_every_micro",
        (fault("TransformPerMicroBatch", max_norm=1.0),),
        "clipping",
        {"name": "deepspeed", "zero_stage": 3},
        note="verify's replay names the clip from step 1's record; ZeRO-3's reduction checksum, where it runs, stops "
        "the run at step 1 before that record (the reduced partitions are not what the local gradients add up to)",
    ),
    Bug(
        "deepspeed_default_clipping",
        "DeepSpeed's gradient_clipping default (1.0)",
        "optim.clip_norm=null; the real deepspeed.initialize gets the generated config without gradient_clipping, "
        "so DeepSpeed's default since #8068, 1.0, applies",
        "gpt_unclipped",
        (fault("DeepSpeedDefaultClipping"),),
        "known_error",
        {"name": "deepspeed", "zero_stage": 1},
    ),
    Bug(
        "fsdp2_skipped_reduction",
        "a skipped reduction (FSDP2)",
        "a no_sync helper that never re-enables sync: the window's last micro-batch runs with "
        "set_requires_gradient_sync(False) too, so no reduce-scatter runs and the optimizer steps without gradients",
        "gpt",
        (fault("SkippedBoundarySync", "reduction"),),
        "rank_divergence",
        {"name": "fsdp"},
        note="every rank skips alike, so no two ranks disagree: the sharded reduction checksum catches it",
    ),
    Bug(
        "zero3_skipped_reduction",
        "a skipped reduction (ZeRO-3)",
        "ZeRO-3's gradient reduce-scatter runs but every rank keeps its own unreduced partition",
        "gpt",
        (fault("CorruptReduction", "reduction", mode="skip"),),
        "rank_divergence",
        {"name": "deepspeed", "zero_stage": 3},
    ),
    Bug(
        "outer_sign_flipped",
        "DiLoCo pseudo-gradient with the wrong sign",
        "each island sends local - global instead of global - local (torchft #233, torchtitan #1507): the outer "
        "step moves away from the islands' progress",
        "gpt_diloco",
        (fault("PseudoGradientSignFlipped", "outer"),),
        "outer_sign_flipped",
        note="every island flips alike, so the islands agree: only the simulator tells, at the first outer step",
    ),
    Bug(
        "outer_sum_as_mean",
        "the islands' SUM used as their mean (DiLoCo)",
        "the all-reduced SUM of the 2 islands' pseudo-gradients used as their mean, never divided by the islands "
        "(torchft #286): the outer step is 2x too large",
        "gpt_diloco",
        (fault("SumAsMean", "outer"),),
        "outer_sum_as_mean",
    ),
    Bug("control", "control: no bug", "the base configuration as it is", "gpt", control=True),
    Bug(
        "control_outer",
        "control: DiLoCo, no bug",
        "the DiLoCo configuration as it is: 2 islands of 1 rank whose token counts differ, so a merge that weighs "
        "them equally instead of by their tokens fails verify at the first outer step",
        "gpt_diloco",
        control=True,
    ),
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
            "accum": {**base.get("accum", {}), "micro_batch": SPLIT.micro_batch, "steps": SPLIT.accum_steps},
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


ZOO_LOG = "zoo-worker.log"
"""A candidate's console output in the zoo's shared launch (verify copies it into ``console.log``)."""
ZOO_STATUS = "zoo-status.json"
"""A candidate's exit code (1 when any rank raised) and wall time in the zoo's shared launch."""


def zoo_worker(runs_file: Path) -> None:
    """One rank of the zoo's launch: every bug's candidate, one after the other, each a fresh
    :class:`~distaccum.trainer.Trainer` on the launched process group (as the CLI's worker runs one), its
    faults installed when its components are built and removed after it. A run that raises (the
    fingerprint, a crash the bug causes) raises on every rank at the same point; the ranks then agree on
    its exit code and go on with the next."""
    import torch
    import torch.distributed as dist

    from distaccum.preflight import instantiate_components
    from distaccum.runtime.contracts import DistEnv
    from distaccum.runtime.procgroup import ensure_process_group, gather_rows
    from distaccum.trainer import Trainer

    ensure_process_group(DistEnv.from_environ(os.environ), torch.device("cpu"))
    for values in json.loads(runs_file.read_text()):
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
        codes = gather_rows([code])  # every rank finished this run before the next starts
        if dist.get_rank() == 0:
            write_json(
                run_dir / ZOO_STATUS,
                {"exit_code": int(codes.max()), "seconds": time.perf_counter() - started},
            )


def run_candidates(root: Path, configs: list[RunConfig]) -> int:
    """Every candidate in ONE 2-rank launch (``python -m distaccum _bugzoo_worker RUNS``): process start-up,
    not the tiny runs, dominates the zoo's time. Returns the launch's exit code."""
    runs = root / "zoo-runs.json"
    runs.write_text(json.dumps([to_mapping(c) for c in configs], indent=2) + "\n")
    launch_recipe = LaunchRecipe(
        nnodes=1,
        nproc=SPLIT.world_size,
        rdzv_endpoint="127.0.0.1:0",
        rdzv_id="bugzoo",
        max_restarts=0,
        run_dir=str(root),
    )
    with output_to(root / ZOO_LOG, append=True):
        return launch(launch_recipe, ["-m", "distaccum", "_bugzoo_worker", str(runs)])


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
        # relative to the link's own folder, whatever the zoo's root is relative to (issue 56: a relative root made
        # every link dangle, and every row read "the reference run failed")
        reference = os.path.relpath(ref_root / "reference", bug_dir)
        (bug_dir / "reference").symlink_to(reference, target_is_directory=True)
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
