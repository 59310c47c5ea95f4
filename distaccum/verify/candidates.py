"""Which runs a verification launches, and with what (pure): the candidate splits, the reference's and each
candidate's configuration (a feature's own needs from its rules, :mod:`distaccum.verify.rules`), the sync mode each
candidate runs and the tolerances they are held to."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from distaccum.components import Components, ModelRecipe
from distaccum.config import RunConfig, valid_splits
from distaccum.engines import engine_class
from distaccum.resolve import resolve_sync
from distaccum.rundir.weights import save_weights
from distaccum.runtime.topology import resolve_replicas
from distaccum.split import Split
from distaccum.verify.compare import (
    UNIT_ROUNDOFF,
    Tolerances,
    reduction_roundings,
    tolerance_for,
    with_reduction,
)
from distaccum.verify.rules import rules_for


def candidate_splits(cfg: RunConfig) -> list[Split]:
    """The configured split, plus with ``verify.splits=auto`` other splits of the same global batch.

    World sizes go up to ``trainer.nproc`` (one node; with ``engine.replicas=R``, multiples of R). The reference's own split (world 1, one
    micro-batch) is never a candidate. Extra candidates alternate between world sizes (largest
    first) and between most and least accumulation, so a small bound still covers the extremes.
    """
    configured = cfg.split(cfg.trainer.nproc)
    chosen = [configured]
    fixed = any(
        rule.fixed_split for rule in rules_for(cfg)
    )  # e.g. outer sync's islands are cut from the split
    if cfg.verify.splits == "auto" and not fixed:
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
            **{
                "global_batch": None,
                **{k: v for r in rules_for(cfg) for k, v in r.accum_at(cfg, split).items()},
            },
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
