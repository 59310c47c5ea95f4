"""What ``accum.exact=true`` refuses, before any worker starts (:func:`distaccum.resolve.resolve` and ``prepare``).

Each refusal is something that would make the result depend on the split again, or a path not built for it."""

from __future__ import annotations

import os

from torch import nn

from distaccum.engines.base import EngineBase, EngineSpec
from distaccum.exact.fixed_point import MAX_PIECES

BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def check_exact(
    spec: EngineSpec, engine: type[EngineBase], *, loss_norm: str, gns: bool, compiled: bool, outer: str
) -> None:
    """Raise ValueError for a run ``accum.exact=true`` cannot make split-invariant (nothing when ``spec.exact`` is
    off): ``loss_norm``, ``gns``, ``compiled`` and ``outer`` are ``accum.loss_norm``, ``log.gns``,
    ``trainer.compile`` and ``outer.method``."""
    if not spec.exact:
        return
    why = refusal(spec, engine, loss_norm=loss_norm, gns=gns, compiled=compiled, outer=outer)
    if why is not None:
        raise ValueError(f"accum.exact=true: {why}")


def refusal(
    spec: EngineSpec, engine: type[EngineBase], *, loss_norm: str, gns: bool, compiled: bool, outer: str
) -> str | None:
    """The first reason ``accum.exact`` cannot run this configuration, or None."""
    if not engine.exact_accumulation:
        return (
            f"engine={engine.name} is not supported (exact accumulation needs each micro-batch's whole local "
            "gradient after its backward and the boundary reduction replaced by an int64 sum: engine=ddp and "
            "engine=fsdp do that; DeepSpeed and Accelerate reduce inside their own step). Use engine=ddp or fsdp"
        )
    pieces = spec.split.global_batch // spec.split.micro_batch
    refused = [
        (
            spec.replicas > 1,
            f"engine.replicas={spec.replicas}: HSDP reduces in two stages; exact mode is flat",
        ),
        (
            not engine.replicated_gradients and spec.clip_norm is not None,
            f"optim.clip_norm={spec.clip_norm} with engine={engine.name}: a sharded gradient's norm is a float sum "
            "over the ranks' shards, which differs with the world size; set optim.clip_norm=null",
        ),
        (
            spec.sync != "boundary",
            f"accum.sync={spec.sync}: the fixed-point sum is reduced once, at the boundary",
        ),
        (
            spec.reduce_dtype != "fp32",
            f"accum.reduce_dtype={spec.reduce_dtype}: the reduction is an int64 sum",
        ),
        (
            spec.precision.loss_scaling,
            "precision=fp16: its loss scale follows overflows; use fp32, fp64 or bf16",
        ),
        (
            loss_norm != "global_count",
            "accum.loss_norm=mean_per_micro: the classic loss/K is a negative control",
        ),
        (gns, "log.gns=true: the noise scale reads the engine's float reduction, which never runs here"),
        (compiled, "trainer.compile=true: the pieces' random draws are seeded for eager kernels"),
        (outer != "none", f"outer.method={outer}: islands reduce apart"),
        (
            pieces > MAX_PIECES,
            f"{pieces} pieces per step (global_batch / micro_batch): the headroom holds at most {MAX_PIECES}",
        ),
    ]
    for hit, why in refused:
        if hit:
            return f"{why} (refused)"
    if spec.device.type == "cuda" and not os.environ.get("CUBLAS_WORKSPACE_CONFIG"):
        return (
            "deterministic cuBLAS needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) in the workers' environment "
            "(torch.use_deterministic_algorithms); export it before the launch"
        )
    return None


def check_exact_model(model: nn.Module) -> None:
    """Refuse batch statistics: a BatchNorm's statistics and running buffers depend on how samples meet."""
    norms = [name for name, module in model.named_modules() if isinstance(module, BATCH_NORMS)]
    if norms:
        raise ValueError(
            f"accum.exact=true: the model has batch normalization ({', '.join(norms[:3])}): its statistics "
            "depend on which samples share a forward, which exact mode does not make split-invariant (per-piece "
            "statistics are not built); use LayerNorm/GroupNorm, or train without accum.exact"
        )
