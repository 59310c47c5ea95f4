"""The DeepSpeed config, generated from ours, and the merge of a user JSON (pure; no DeepSpeed import).

DeepSpeed insists that ``train_batch_size = train_micro_batch_size_per_gpu *
gradient_accumulation_steps * world_size``; generating all three from one resolved :class:`Split`
makes that true by construction. A user file (``engine.deepspeed_config``) may add any key we do
not set (bucket sizes, ``overlap_comm``, ``wall_clock_breakdown``, ...). Setting a key we set to a
different value is an error naming both values — never a silent override — and :func:`check` runs
from config validation, before any worker starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from distaccum.engines.base import EngineSpec

FORBIDDEN = {
    "optimizer": "distaccum builds the optimizer from optim.* and hands it to DeepSpeed",
    "scheduler": "distaccum steps its own learning-rate schedule (optim.schedule) once per optimizer step",
    "amp": "use precision=bf16|fp16 (DeepSpeed's own mixed precision)",
}
"""User-config sections we refuse outright, and why."""


def generate(spec: EngineSpec) -> tuple[dict[str, Any], dict[str, str]]:
    """Our DeepSpeed config for ``spec.split``, and for each dotted key the setting it comes from."""
    split, precision, stage = spec.split, spec.precision.name, spec.engine.zero_stage
    clip = spec.clip_norm or 0.0  # DeepSpeed: 0.0 disables clipping
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": split.micro_batch,
        "gradient_accumulation_steps": split.accum_steps,
        "train_batch_size": split.global_batch,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "fp16": {"enabled": precision == "fp16"},
        "bf16": {"enabled": precision == "bf16"},
        # We pass our own torch optimizer (optim.name); DeepSpeed only trusts its own for ZeRO.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,  # our sinks report progress; DeepSpeed's log would duplicate it
    }
    sources = {
        "train_micro_batch_size_per_gpu": f"accum.micro_batch={split.micro_batch}",
        "gradient_accumulation_steps": f"accum.steps={split.accum_steps} (resolved split)",
        "train_batch_size": (
            f"the global batch {split.global_batch} = micro_batch {split.micro_batch} x "
            f"{split.accum_steps} steps x {split.world_size} ranks"
        ),
        "gradient_clipping": f"optim.clip_norm={spec.clip_norm}",
        "zero_optimization.stage": f"engine.zero_stage={stage}",
        "fp16.enabled": f"precision={precision}",
        "bf16.enabled": f"precision={precision}",
        "zero_allow_untested_optimizer": "optim.name (distaccum builds the torch optimizer)",
        "steps_per_print": "distaccum's own progress reporting",
    }
    if spec.reduce_dtype != "fp32":  # DeepSpeed's dtype of its gradient collectives
        config["communication_data_type"] = spec.reduce_dtype
        sources["communication_data_type"] = f"accum.reduce_dtype={spec.reduce_dtype}"
    return config, sources


def merge(
    ours: dict[str, Any],
    user: dict[str, Any],
    sources: dict[str, str],
    origin: str = "the user DeepSpeed config",
) -> dict[str, Any]:
    """``ours`` plus every key of ``user`` we do not set; raises ValueError on any conflict."""
    for key, why in FORBIDDEN.items():
        if key in user:
            raise ValueError(f"{origin} has a {key!r} section, which distaccum does not accept: {why}")
    conflicts: list[str] = []
    merged = _merge(ours, user, "", sources, conflicts)
    if conflicts:
        raise ValueError(
            f"{origin} conflicts with the configuration distaccum generates: "
            + "; ".join(conflicts)
            + ". Change the distaccum setting, or remove the key from the file."
        )
    return merged


def _same(a: Any, b: Any) -> bool:
    # JSON has one number type: 4 and 4.0 agree, True and 1 do not.
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return float(a) == float(b)
    return bool(a == b)


def _merge(
    ours: dict[str, Any], user: dict[str, Any], prefix: str, sources: dict[str, str], conflicts: list[str]
) -> dict[str, Any]:
    out = dict(ours)
    for key, value in user.items():
        path = f"{prefix}{key}"
        if key not in ours:
            out[key] = value
        elif isinstance(ours[key], dict) and isinstance(value, dict):
            out[key] = _merge(ours[key], value, f"{path}.", sources, conflicts)
        elif isinstance(ours[key], dict) or isinstance(value, dict) or not _same(ours[key], value):
            conflicts.append(
                f"{path}={json.dumps(value)} in the file, but {json.dumps(ours[key])} from "
                f"{sources.get(path, 'distaccum')}"
            )
    return out


def load_user_config(path: str) -> dict[str, Any]:
    """Read the user JSON (relative paths: from the current directory, where workers run too)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"engine.deepspeed_config={path!r}: no such file (from {Path.cwd()})")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"engine.deepspeed_config={path!r} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(
            f"engine.deepspeed_config={path!r} must hold a JSON object, got {type(data).__name__}"
        )
    return data


def build(spec: EngineSpec) -> dict[str, Any]:
    """The config passed to ``deepspeed.initialize``: generated, plus the user file if any."""
    ours, sources = generate(spec)
    path = spec.engine.deepspeed_config
    if not path:
        return ours
    return merge(ours, load_user_config(path), sources, origin=f"engine.deepspeed_config={path!r}")


def check(spec: EngineSpec) -> None:
    """Validate a DeepSpeed run (with the user JSON if any) for the launch's world size.

    Raises ValueError; the entry layer calls it, so errors come before any worker starts.
    """
    stage, precision = spec.engine.zero_stage, spec.precision.name
    if spec.sync == "every_micro" and stage < 2:
        raise ValueError(
            f"accum.sync=every_micro with engine=deepspeed engine.zero_stage={stage}: ZeRO-0/1 reduce only "
            "at the accumulation boundary (declaring every micro-batch a boundary makes ZeRO-1/2 drop "
            "accumulated gradients); use accum.sync=boundary, or zero_stage 2/3, which reduce on every "
            "micro-batch by design"
        )
    if precision == "fp64":
        # ZeRO 1-3 would train, but their master weights are always fp32 (DeepSpeed 0.19
        # ZeROOptimizer._configure_master_weights): every update rounds through fp32, ~1e-7 off.
        why = (
            "DeepSpeed refuses fp64 gradients"
            if stage == 0
            else (
                "its ZeRO optimizer keeps fp32 master weights, so every update would round through fp32 "
                "(~1e-7 relative) while the run claims fp64"
            )
        )
        raise ValueError(
            f"precision=fp64 with engine=deepspeed engine.zero_stage={stage} is unsupported: {why}. "
            "Use engine=ddp, fsdp or accelerate for fp64, or precision=fp32 with DeepSpeed"
        )
    if precision == "bf16" and stage == 0:
        # Found by tests/test_ground_truth.py: the weights moved before the first window.
        raise ValueError(
            "precision=bf16 with engine=deepspeed engine.zero_stage=0 is unsupported: DeepSpeed runs it "
            "with its FP16_UnfusedOptimizer, which steps the optimizer once on zero gradients when it is "
            "created (weight decay, AdamW's step count and SGD's momentum move before training starts) "
            "and has no loss scale for distaccum's normalization to act through. Use "
            "engine.zero_stage=1..3 with bf16, or precision=fp32 with ZeRO-0"
        )
    if precision == "fp16":
        raise ValueError(
            "engine=deepspeed precision=fp16 is not supported by distaccum: DeepSpeed's dynamic "
            "loss scaler would be replaced by the window normalization (see docs/engines.md); "
            "use precision=bf16, which needs no loss scaling"
        )
    if spec.engine.deepspeed_config:
        build(spec)
