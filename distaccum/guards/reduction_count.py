"""The reduction count: every step, the micro-batches that reduced gradients against what ``accum.sync`` promises.

``accum.sync=boundary`` promises one gradient reduction per optimizer step: the window's last micro-batch reduces
what the K micro-batches accumulated. A ``no_sync`` that does nothing keeps the math (FSDP2 sums fresh
reduce-scatters, so K of them add up to the one) and multiplies the communication by K: cosmos-framework #161
(a helper that only knows DDP, a no-op under FSDP2: K = 4 took 4x the time), LoongForge #163 (``no_sync`` around
the backward only: DDP arms its reducer in the forward, so every micro-batch all-reduced), torchrec #4121 (an
inner DDP wrapper that the outer ``no_sync`` does not reach). Under distaccum's summing DDP hook an extra
all-reduce corrupts the gradient too (the reduced part is summed again, times the world size).

The engine's ledger already counts, per step, the micro-batches in which a gradient collective was launched (its
comm hook, or the tap around the engine's backward: ``comm_rounds`` in the records); the engine states what its
``accum.sync`` mode promises (:meth:`~distaccum.engines.base.EngineBase.reduction_rounds`). This monitor compares
the two right after each optimizer step, before the step's record, and warns at the first step they differ
(stderr and ``warnings.jsonl``, rank 0, once): check ``reduction_count``, which ``distaccum verify`` diagnoses even
when the weights agree. A warning, not a stop: a model whose own backward all-reduces (SyncBatchNorm) inside an
engine whose reductions are tapped (FSDP2, DeepSpeed) shows extra rounds too. What no hook or tap sees is not
counted: a DDP with torch's built-in C++ all-reduce (no comm hook) inside the model.

No collective, no device work: a count of the ledger's launches on the host. World size 1 reduces nothing and is
skipped; so is an engine that promises nothing (DeepSpeed where it cannot coalesce the window).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from distaccum.rundir import WARNINGS
from distaccum.window import WindowResult

CHECK = "reduction_count"
"""The ``check`` of its warning in ``warnings.jsonl``."""


class ReductionCount:
    """A :class:`~distaccum.loop.StepMonitor`: the ledger's rounds of each step against the engine's promise."""

    def __init__(self, engine: Any, run_dir: Path, rank: int, world_size: int) -> None:
        self.ledger, self.engine = engine.ledger, engine
        self.promises = world_size > 1 and engine.reduction_rounds() is not None
        self.run_dir, self.rank, self.sync = run_dir, rank, engine.spec.sync
        self.warned = False

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None:
        if not self.promises or self.warned:
            return
        promise = self.engine.reduction_rounds(self.ledger.micro_batches())  # this step's K (a growing batch)
        seen = self.ledger.rounds()
        if seen == promise:
            return
        self.warned = True
        if self.rank == 0:
            message = describe(step, seen, promise, self.sync)
            print(f"distaccum: warning: {message}", file=sys.stderr, flush=True)
            with open(self.run_dir / WARNINGS, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "check": CHECK, "message": message}) + "\n")

    def fields(self, record: dict[str, Any], times: object, records: list[dict[str, Any]]) -> dict[str, Any]:
        return {}


EXTRA = "gradients were reduced on micro-batches that should only accumulate"
"""How the warning begins its cause when more micro-batches reduced than ``accum.sync`` promises."""


def describe(step: int, seen: tuple[int, int], promise: tuple[int, int], sync: str) -> str:
    """The warning: which step, how many micro-batches reduced, how many ``accum.sync`` promises, and why."""
    what = f"{seen[0]} of the window's micro-batches reduced gradients"
    expected = f"accum.sync={sync} promises {promise[0]}"
    if seen[1] != promise[1]:
        what += f" ({seen[1]} across replicas)"
        expected += f" ({promise[1]} across replicas)"
    cause = (
        f"{EXTRA}: a no_sync that does nothing "
        "(around the backward only, where DDP already armed its reducer in the forward; a helper that does not "
        "know the wrapper, e.g. FSDP2), or a nested DDP the outer no_sync does not reach. The step costs that many "
        "times the communication, and under a summing reduction the gradient is wrong too"
        if seen[0] > promise[0] or seen[1] > promise[1]
        else "a reduction the window needs did not run (the reduction fingerprint and the tripwire judge the "
        "gradient)"
    )
    return f"optimizer step {step}: {what}, {expected} (reduction count): {cause}"
