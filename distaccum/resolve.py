"""Resolve a run once: the configuration and the world it runs on become the narrow objects each part uses.

::

    RunConfig + world size + device  --resolve()-->  ResolvedRun
        split       accum.* on this world (micro_batch=auto: provisional until the Trainer measures it)
        precision   the fp32 | fp64 | bf16 | fp16 policy
        engine      the EngineSpec (built here and nowhere else), checked against the engine's class
        loop        LoopSettings
        data        DataOptions: how the global-batch order walks the data, how the loaders read it
        model       ModelRecipe: seed, precision, init_from (identical initial weights everywhere)

    ResolvedRun + the user's components  --prepare()-->  Prepared
        the model built and checked (activation checkpointing, its compatibility with the engine,
        the normalization probe, a warning for batch statistics), the held-out set, and the
        run identity a checkpoint must match to be resumed

Pre-flight (:mod:`distaccum.preflight`), the :class:`~distaccum.trainer.Trainer`, ``micro_batch=auto``,
``distaccum plan`` and ``distaccum verify`` all go through these two functions; below them nothing
takes the whole :class:`~distaccum.config.RunConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from distaccum.activation_checkpointing import apply_activation_checkpointing, check_engine_compatible
from distaccum.batching.growth import BatchGrowth
from distaccum.components import Components, ModelRecipe
from distaccum.config import OptimConfig, RunConfig, check_split, resolve_split, to_mapping
from distaccum.data.sources import DataOptions
from distaccum.data.stream import is_stream
from distaccum.engines import check_engine, engine_class
from distaccum.engines.base import EngineSpec, Precision
from distaccum.evaluate import eval_dataset
from distaccum.exact.checks import check_exact, check_exact_model
from distaccum.loop import LoopSettings
from distaccum.models import batch_stat_layers
from distaccum.optim import build_optimizer
from distaccum.outer.islands import IslandLayout, resolve_islands
from distaccum.probe import probe
from distaccum.rundir.checkpoint import data_signature, model_signature
from distaccum.runtime.topology import resolve_replicas
from distaccum.split import Split


@dataclass(frozen=True)
class ResolvedRun:
    """One run on one world, resolved: what every part below the Trainer is handed (narrow pieces)."""

    world_size: int
    rank: int
    device: torch.device
    split: Split
    """The split; with ``micro_batch=auto`` before the Trainer measured it, a provisional one (micro-batch
    1) of the same global batch."""
    auto: bool
    """``accum.micro_batch=auto`` and not yet measured."""
    precision: Precision
    engine: EngineSpec
    loop: LoopSettings
    data: DataOptions
    model: ModelRecipe
    optim: OptimConfig
    run_dir: Path
    outer_islands: int = 0
    """Islands of an outer-synced run (``outer.method`` other than none); 0: none."""

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.split.global_batch

    def with_split(self, split: Split) -> ResolvedRun:
        """The same run at another split of the world (``micro_batch=auto`` trials, the planner)."""
        return dataclasses.replace(
            self,
            split=split,
            auto=False,
            engine=dataclasses.replace(self.engine, split=split),
            loop=dataclasses.replace(self.loop, split=split),
        )

    def optimizer(self, parts: Components) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
        """The optimizer factory: the user's, else ``optim.*``."""
        return parts.optimizer or (lambda params: build_optimizer(params, self.optim))

    def summary_header(self, model_name: str) -> dict[str, Any]:
        """The run-description fields of ``summary.json``."""
        return {
            "engine": self.engine.engine.name,
            "model": model_name,
            "precision": self.precision.name,
            "sync": self.engine.sync,
            "replicas": self.engine.replicas,
            "reduce_dtype": self.engine.reduce_dtype,
            "loss_norm": self.loop.loss_norm,
            "world_size": self.split.world_size,
            "micro_batch": self.split.micro_batch,
            "accum_steps": self.split.accum_steps,
            "global_batch": self.split.global_batch,
            "lr_scaling": self.optim.lr_scaling,
            "base_batch": self.optim.base_batch,
        }


def resolve(
    cfg: RunConfig,
    world_size: int,
    device: torch.device,
    *,
    rank: int = 0,
    micro_batch: int | None = None,
    nodes: int = 1,
) -> ResolvedRun:
    """Resolve ``cfg`` for ``world_size`` ranks on ``nodes`` nodes on ``device``; ``micro_batch`` is what
    ``micro_batch=auto`` chose. Raises ValueError for a split the world cannot take or a combination the
    engine cannot run."""
    check_split(cfg.accum, world_size)  # no split on this world: ValueError naming the valid ones
    auto = cfg.accum.auto and micro_batch is None
    if auto:
        split = Split(1, cfg.global_batch(world_size) // world_size, world_size)
    else:
        accum = dataclasses.replace(cfg.accum, micro_batch=micro_batch) if micro_batch else cfg.accum
        split = resolve_split(accum, world_size)
    precision = Precision.of(cfg.precision)
    if cfg.log.gns and not engine_class(cfg.engine.name).supports_gns:
        raise ValueError(
            f"log.gns=true reads the gradients the comm hook reduces once per step; engine="
            f"{cfg.engine.name} has no such hook (engines that do: ddp)"
        )
    if cfg.log.gns and world_size < 2:
        raise ValueError(
            "log.gns=true compares each rank's gradient with the reduced one: it needs at least "
            f"2 ranks, got world_size={world_size}"
        )
    replicas = resolve_replicas(
        cfg.engine.replicas, engine_class(cfg.engine.name).hybrid_sharding, world_size, nodes
    )
    islands = outer_islands(cfg, world_size, nodes)
    replicas = 1 if islands else replicas  # outer-synced: the islands are the replicas (no HSDP inside one)
    sync = resolve_sync(cfg.accum.sync, replicas)
    spec = EngineSpec(
        engine=cfg.engine,
        precision=precision,
        split=split,
        sync=sync,
        clip_norm=cfg.optim.clip_norm,
        device=device,
        gns=cfg.log.gns,
        replicas=replicas,
        reduce_dtype=cfg.accum.reduce_dtype,
        compile_mode=cfg.trainer.compile_mode if cfg.trainer.compile else None,
        measure_norm=cfg.log.grad_norm or cfg.optim.clip_norm is not None,
        sample_grads=cfg.trainer.fingerprint and world_size // max(islands, 1) > 1,
        exact=cfg.accum.exact,
    )
    check_engine(spec)
    check_exact(
        spec,
        engine_class(cfg.engine.name),
        loss_norm=cfg.accum.loss_norm,
        gns=cfg.log.gns,
        compiled=cfg.trainer.compile,
        outer=cfg.outer.method,
    )
    loop = LoopSettings(
        split=split,
        max_steps=cfg.trainer.max_steps,
        max_samples=cfg.trainer.max_samples,
        clip_norm=cfg.optim.clip_norm,
        every_micro=sync == "every_micro",
        loss_norm=cfg.accum.loss_norm,
        float_dtype=torch.float64 if precision.param_dtype == torch.float64 else None,
        device=device,
        rank=rank,
    )
    data = DataOptions(
        seed=cfg.trainer.seed,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
        num_workers=cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor,
        growth=batch_growth(cfg, split, islands),
    )
    return ResolvedRun(
        world_size=world_size,
        rank=rank,
        device=device,
        split=split,
        auto=auto,
        precision=precision,
        engine=spec,
        loop=loop,
        data=data,
        model=ModelRecipe(cfg.trainer.seed, precision, cfg.trainer.init_from),
        optim=cfg.optim,
        run_dir=Path(cfg.run_dir),
        outer_islands=islands,
    )


GROWTH_ENGINES = ("ddp", "fsdp")


def batch_growth(cfg: RunConfig, split: Split, islands: int = 0) -> BatchGrowth | None:
    """The global batch per step of ``accum.ramp`` / ``accum.adaptive`` on ``split``'s world (None: constant);
    ValueError for a phase without a split or what cannot follow a growing batch."""
    accum = cfg.accum
    if not (accum.ramp.enabled or accum.adaptive.enabled):
        return None
    what = "accum.ramp" if accum.ramp.enabled else "accum.adaptive"
    if cfg.engine.name not in GROWTH_ENGINES:
        raise ValueError(
            f"{what} changes K between optimizer steps; engine={cfg.engine.name} fixes its accumulation steps when "
            f"it is built (DeepSpeed's gradient_accumulation_steps, Accelerate's accumulation plugin): use "
            f"engine=ddp or engine=fsdp"
        )
    if islands:
        raise ValueError(f"{what} is not supported with outer.method={cfg.outer.method}")
    assert accum.global_batch is not None  # AccumConfig checks
    if accum.adaptive.enabled:
        if not cfg.log.gns:
            raise ValueError(
                "accum.adaptive.enabled=true follows the gradient noise scale log.gns measures: set log.gns=true"
            )
        growth = BatchGrowth.constant(accum.global_batch)
    else:
        growth = BatchGrowth.of(accum.ramp, accum.global_batch)
    growth.check([split.world_size], None if cfg.accum.auto else split.micro_batch)
    return growth


OUTER_ENGINES = ("ddp", "fsdp")


def outer_islands(cfg: RunConfig, world_size: int, nodes: int) -> int:
    """The islands of an outer-synced run (0 when ``outer.method=none``); ValueError for what it cannot run."""
    outer = cfg.outer
    if not outer.enabled:
        return 0
    islands = resolve_islands(outer.islands, world_size, nodes)
    IslandLayout.of(world_size, 0, islands)  # ValueError when it does not divide
    if cfg.engine.name not in OUTER_ENGINES:
        raise ValueError(
            f"outer.method={outer.method} runs each island's step on engine=ddp or engine=fsdp; engine="
            f"{cfg.engine.name} is not supported inside an island yet (DeepSpeed and Accelerate reduce over the "
            "whole world)"
        )
    if cfg.engine.replicas not in ("auto", 1):
        raise ValueError(
            f"outer.method={outer.method} with engine.replicas={cfg.engine.replicas}: HSDP inside an island is not "
            "supported; the islands (outer.islands) take the replicas' place"
        )
    if cfg.log.gns:
        raise ValueError(f"log.gns=true is not supported with outer.method={outer.method}")
    return islands


def resolve_sync(sync: str, replicas: int) -> str:
    """``accum.sync`` as a mode: ``auto`` is ``replica_boundary`` on HSDP (``replicas`` > 1), else ``boundary``."""
    if sync != "auto":
        return sync
    return "replica_boundary" if replicas > 1 else "boundary"


@dataclass
class Prepared:
    """The user's model built and checked for a resolved run, and what follows from it."""

    model: nn.Module
    checkpointed: list[str]
    """Modules that recompute their activations in backward (activation checkpointing)."""
    collate: Callable[[list[Any]], Any]
    eval_set: Dataset | None
    identity: dict[str, Any]
    """The run identity (:func:`run_identity`)."""
    names: dict[str, str]


def prepare(
    cfg: RunConfig,
    run: ResolvedRun,
    parts: Components,
    *,
    model: nn.Module | None = None,
    check_components: bool = True,
) -> Prepared:
    """Build the model as every rank builds it (or take ``model``, built by ``run.model``) and check everything
    that needs it (ValueError on failure): activation checkpointing and the engine, the normalization probe
    (``check_components``), the data order, the held-out set. Warns when batch-statistics layers meet
    accumulation."""
    names = parts.describe()
    model = model if model is not None else run.model.build(parts)
    checkpointed = apply_activation_checkpointing(model, parts.activation_checkpointing)
    check_engine_compatible(model, run.engine.engine.name)
    if run.engine.exact:
        check_exact_model(model)
    collate = parts.collate or default_collate
    if check_components:
        probe(model, parts.dataset, collate, parts.loss, names=names)
    if not is_stream(parts.dataset):
        run.data.order(
            parts.dataset, run.global_batch
        )  # an order that would never run a window is an error now
    layers = batch_stat_layers(model)
    if layers and run.split.accum_steps > 1 and not run.auto:
        warnings.warn(
            f"accumulating {run.split.accum_steps} micro-batches with batch-statistics layers "
            f"({', '.join(layers)}): their statistics are computed per micro-batch of {run.split.micro_batch}, "
            "not over the effective batch, so results depend on the split",
            stacklevel=3,
        )
    eval_set = eval_dataset(cfg.eval, parts.dataset, parts.eval_dataset)
    return Prepared(
        model,
        checkpointed,
        collate,
        eval_set,
        run_identity(cfg, run.world_size, names, parts.dataset, model),
        names,
    )


def run_identity(
    cfg: RunConfig, world_size: int, names: Mapping[str, str], dataset: Any, model: nn.Module
) -> dict[str, Any]:
    """The run identity: the record that a checkpoint keeps and a resume is compared with
    (:mod:`distaccum.rundir.changes` classifies every difference): each configuration setting as
    ``section.field`` (the model's node as ``model.node``), and what the configuration alone does not
    show — the model's architecture (``model``), the components' names, the data's signature, the global
    batch and, for engines whose checkpoints do not reshard, the world size. JSON values, as a checkpoint
    reads them back."""
    engine = engine_class(cfg.engine.name)
    out: dict[str, Any] = {}
    for key, value in to_mapping(cfg).items():
        if isinstance(value, dict) and key not in ("model", "loss"):
            out.update({f"{key}.{field}": v for field, v in value.items()})
        else:
            out["model.node" if key == "model" else key] = value
    out.update(
        {
            "model": model_signature(model),
            "loss": cfg.loss or names.get("loss"),
            "data.dataset": cfg.data.dataset or names.get("dataset"),
            "data.collate": cfg.data.collate or names.get("collate"),
            "data.signature": data_signature(dataset),
            "global_batch": cfg.global_batch(world_size),
            **engine.identity(cfg.engine),
        }
    )
    if (
        not engine.reshardable_checkpoints or cfg.outer.enabled
    ):  # outer-synced: per-island state, one file per rank
        out["world_size"] = world_size
    return json.loads(json.dumps(out, default=str))
