"""What a resume may change: every setting that differs between a checkpoint's record and the resuming
configuration, classified in one table and reported in one place.

- **allowed**: the run stays the run it was — topology at the same global batch (world size, nproc, nodes,
  micro-batch x accumulation steps), logging, evaluation, checkpoint and check cadence, launch and
  cluster settings, ``max_steps`` under a constant schedule. Reported, then resumed.
- **explicit**: ``max_steps`` under a decaying schedule moves the learning rate's horizon; refused unless
  ``trainer.schedule_on_resume`` says how (``keep`` the original schedule, or ``stretch`` it from here).
- **refused**: anything that changes the math or the data — the global batch, the optimizer and its
  schedule, the learning rate, clipping, the model, the loss and its normalization, the data source, its
  order and the seed, the precision, the engine's partitioning (and the world size for engines whose
  checkpoints do not reshard). Exit 2 before any worker starts, one paragraph per key.

Every field of :class:`~distaccum.config.RunConfig` has a class here (a test holds the table complete); a
recorded key the table does not know is refused.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from distaccum.outer.config import RENAMED_KEYS

ALLOWED = "allowed"
EXPLICIT = "explicit"
REFUSED = "refused"

_CADENCE = "logging, evaluation, checkpointing and checks do not change the math"
_TOPOLOGY = "the global batch is unchanged, so every optimizer step sees the same samples"
_LAUNCH = "how the workers are launched or supervised, not what they compute"
ALLOWED_KEYS: dict[str, str] = {
    **dict.fromkeys(("trainer.nproc", "trainer.nnodes"), _TOPOLOGY),
    **dict.fromkeys(
        ("accum.micro_batch", "accum.steps", "accum.global_batch", "accum.memory_budget"), _TOPOLOGY
    ),
    "accum.sync": "when the reduction runs, not what it sums",
    **dict.fromkeys(("log.", "eval.", "verify."), _CADENCE),
    **dict.fromkeys(
        (
            "trainer.checkpoint_every",
            "trainer.checkpoint_every_s",
            "trainer.keep_checkpoints",
            "trainer.check_every",
            "trainer.fingerprint",
            "trainer.max_nonfinite_steps",
            "trainer.save_final",
        ),
        _CADENCE,
    ),
    **dict.fromkeys(
        (
            "trainer.rdzv_endpoint",
            "trainer.rdzv_id",
            "trainer.max_restarts",
            "trainer.rdzv_last_call_s",
            "trainer.collective_timeout_s",
            "trainer.shutdown_grace_s",
            "trainer.device",
            "slurm.",
            "kubeflow.",
            "ray.",
            "ft.",
            "run_dir",
        ),
        _LAUNCH,
    ),
    "trainer.init_from": "the checkpoint's weights replace the initial ones",
    "trainer.max_samples": "where the run ends; the learning rate's horizon is trainer.max_steps",
    **dict.fromkeys(("trainer.resume", "trainer.schedule_on_resume"), "how this resume proceeds"),
    **dict.fromkeys(("trainer.compile", "trainer.compile_mode"), "compilation runs the same model"),
    **dict.fromkeys(
        ("data.num_workers", "data.prefetch_factor"), "how batches are loaded, not which samples they hold"
    ),
    **dict.fromkeys(
        ("engine.bucket_cap_mb", "engine.extensions_dir", "engine.fsdp_unsharded_window", "engine.replicas"),
        "how the engine schedules its communication, not what it reduces",
    ),
}
"""Keys (or ``section.`` prefixes) that may change on a resume, with the reason."""

REFUSED_KEYS: dict[str, str] = {
    "global_batch": "the samples per optimizer step",
    **dict.fromkeys(
        ("accum.ramp", "accum.adaptive"), "the samples of every optimizer step (the batch growth)"
    ),
    "world_size": "how the checkpoint is partitioned (one piece per rank: DeepSpeed's optimizer state, or an "
    "outer-synced run's islands and their outer state)",
    "outer.": "how the islands merge (method, period, fragments, outer optimizer) and which state each island "
    "holds in the checkpoint",
    "optim.": "the optimizer, its learning rate, schedule and clipping",
    "model": "the model's architecture and parameters",
    "model.node": "the model's architecture and parameters",
    "loss": "the loss",
    "accum.loss_norm": "how the loss is normalized",
    "accum.reduce_dtype": "the precision the gradients are reduced in",
    "accum.exact": "how the gradients are accumulated (fixed point: the same bits for every split)",
    **dict.fromkeys(
        ("data.dataset", "data.collate", "data.signature", "data.shuffle", "data.drop_last"),
        "the data and the order it is served in",
    ),
    "trainer.seed": "the data order and every random draw",
    "precision": "the numerics of every step",
    **dict.fromkeys(
        ("engine.name", "engine.zero_stage", "engine.deepspeed_config", "engine.fsdp_reduce_fp32"),
        "how the engine partitions and reduces the run's state",
    ),
}
"""Keys that a resume may not change, with what they decide."""
HORIZON = "trainer.max_steps"
DECAYING = ("cosine", "linear")


@dataclass(frozen=True)
class Change:
    """One setting that differs: its key, both values, its class and the sentence to print."""

    key: str
    saved: Any
    now: Any
    kind: str
    reason: str

    def values(self) -> str:
        return f"{_show(self.saved)} in the checkpoint, {_show(self.now)} now"


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _rule(key: str, table: Mapping[str, str]) -> str | None:
    if key in table:
        return table[key]
    return next(
        (reason for prefix, reason in table.items() if prefix.endswith(".") and key.startswith(prefix)), None
    )


def classify(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[Change]:
    """Every key recorded on both sides whose value differs, in key order, with its class. A key recorded
    on one side only (a checkpoint from another version) is not compared; ``world_size`` is recorded only
    by engines whose checkpoints are partitioned per rank. An old key of the checkpoint's record
    (:data:`~distaccum.outer.config.RENAMED_KEYS`) is compared under its new name."""
    saved = {RENAMED_KEYS.get(key, key): value for key, value in saved.items()}
    schedule = now.get("optim.schedule", "")
    changes = []
    for key in sorted(set(saved) & set(now)):
        if saved[key] == now[key]:
            continue
        if key == HORIZON:
            kind, reason = (
                (EXPLICIT, f"the {schedule} schedule decays to its final learning rate at this step")
                if schedule in DECAYING
                else (ALLOWED, "the constant schedule does not depend on it")
            )
        elif (allowed := _rule(key, ALLOWED_KEYS)) is not None:
            kind, reason = ALLOWED, allowed
        else:
            kind = REFUSED
            reason = _rule(key, REFUSED_KEYS) or "not known to leave the run unchanged"
        changes.append(Change(key, saved[key], now[key], kind, reason))
    return changes


def of_kind(changes: list[Change], kind: str) -> list[Change]:
    return [c for c in changes if c.kind == kind]


ADVICE: dict[str, str] = {
    "global_batch": "set accum.micro_batch x accum.steps x world size (or accum.global_batch) back to it",
    "model": "build the model as the checkpoint's run did",
    "data.signature": "serve the data the checkpoint's run was trained on",
    "world_size": "launch as many ranks as the checkpoint's run",
}
"""What to do about a refused change of a derived key (not a configuration setting)."""


def refusal(change: Change, *, fresh_start: str) -> str:
    """The paragraph for a refused change: the key, both values, what it decides and what to do."""
    back = ADVICE.get(change.key, f"resume with {change.key}={_show(change.saved)}")
    return (
        f"{change.key}: {change.values()}. It decides {change.reason}, so the resumed run would no longer be "
        f"the run the checkpoint belongs to: {back}; or, to train with the new value, {fresh_start}."
    )


def report(changes: list[Change], step: int, schedule_on_resume: str | None = None) -> str:
    """The lines a resume prints about the settings it accepted (empty when nothing changed)."""
    if not changes:
        return ""
    lines = [
        f"distaccum: {len(changes)} setting(s) changed since the checkpoint after optimizer step {step}:"
    ]
    for c in changes:
        chosen = f"; trainer.schedule_on_resume={schedule_on_resume}" if c.kind == EXPLICIT else ""
        lines.append(f"  {c.kind:<8} {c.key}: {_show(c.saved)} -> {_show(c.now)} ({c.reason}{chosen})")
    return "\n".join(lines)
