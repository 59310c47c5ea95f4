"""What torch.compile did during a run: compile time, recompiles and graph breaks, per step.

A :class:`CompileWatch` (a :class:`~distaccum.loop.StepMonitor`, present when ``trainer.compile=true``)
listens to dynamo's compile start/end callbacks. Per step it records ``compile_s`` (seconds spent
compiling in that step, forward and lazily compiled backward graphs: the step's ``time_s`` includes it),
``recompiles`` (frames compiled again for new guards: a new shape, a new grad mode) and ``graph_breaks``
(cumulative, as dynamo counts them). After the warm-up steps a recompile is a cost every time it happens,
so rank 0 says so on the console with dynamo's reason. The summary adds ``compile_s``, ``recompiles``
after warm-up and ``graph_breaks``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from torch._dynamo.callback import CallbackTrigger, callback_handler, on_compile_end, on_compile_start
from torch._dynamo.utils import counters, get_compilation_metrics

from distaccum.window import WindowResult

_lock = threading.Lock()
_events: list[
    tuple[str, float, str, CallbackTrigger]
] = []  # (start | end, perf_counter, compile_id, trigger)


def _start(args: Any) -> None:
    with _lock:
        _events.append(("start", time.perf_counter(), str(args.compile_id), args.callback_trigger))


def _end(args: Any) -> None:
    with _lock:
        _events.append(("end", time.perf_counter(), str(args.compile_id), args.callback_trigger))


def _listen() -> None:
    """Register the module's dynamo callbacks once (again after ``torch._dynamo.reset()``, which drops them)."""
    if _start not in callback_handler.start_callbacks:
        on_compile_start(_start)
    if _end not in callback_handler.end_callbacks:
        on_compile_end(_end)


def is_recompile(compile_id: str) -> bool:
    """Dynamo's compile ids read ``frame/attempt`` (``0/1``: frame 0 compiled a second time)."""
    attempt = compile_id.split("/")[-1].split("_")[0]
    return attempt.isdigit() and int(attempt) > 0


def graph_breaks() -> int:
    """Graph breaks dynamo counted in this process so far."""
    return int(sum(counters["graph_break"].values()))


class CompileWatch:
    """Per-step compile figures (see the module docstring)."""

    def __init__(self, rank: int, warmup_steps: int = 1) -> None:
        _listen()
        self.rank, self.warmup = rank, warmup_steps
        with _lock:
            self._seen = len(_events)
        self._breaks_before = graph_breaks()
        self._ends: dict[int, tuple[int, int]] = {}
        """Per step until its record is made: the events and graph breaks counted when it ended (its record may
        come a step later, :class:`~distaccum.loop.StepEnd`, after the next step compiled)."""

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None:
        with _lock:
            self._ends[step] = (len(_events), graph_breaks())

    def fields(self, record: dict[str, Any], times: object, records: list[dict[str, Any]]) -> dict[str, Any]:
        _listen()  # torch._dynamo.reset() in user code would have dropped the callbacks
        step = int(record["step"])
        with _lock:
            upto, breaks = self._ends.pop(step) if step in self._ends else (len(_events), graph_breaks())
            new, self._seen = _events[self._seen : upto], upto
        starts: dict[tuple[str, CallbackTrigger], float] = {}
        seconds, recompiled = 0.0, []
        for kind, at, compile_id, trigger in new:
            if kind == "start":
                starts[(compile_id, trigger)] = at
                if trigger == CallbackTrigger.DYNAMO and is_recompile(compile_id):
                    recompiled.append(compile_id)
            elif (compile_id, trigger) in starts:
                seconds += at - starts.pop((compile_id, trigger))
        if recompiled and step > self.warmup and self.rank == 0:
            reasons = {str(m.compile_id): m.recompile_reason for m in get_compilation_metrics()}
            why = "; ".join(f"{i}: {reasons.get(i) or 'reason not recorded'}" for i in recompiled)
            hint = (
                " A tensor dimension changed: at index 0 usually the micro-batch size (a partial last window: a "
                "global batch that divides the dataset has none), elsewhere e.g. the sequence length (pad to fixed "
                "lengths: distaccum.datasets.pad_collate's pad_to). Once a dimension is dynamic it does not "
                "recompile again."
                if "size mismatch" in why
                else " A dimension of size 1 (a one-sample micro-batch of a partial last window): torch compiles "
                "size 1 apart. data.drop_last=true, or a global batch that divides the dataset, has none."
                if "0/1 specialization" in why
                else ""
            )
            print(
                f"distaccum: torch.compile recompiled {len(recompiled)} graph(s) at step {step}, after warm-up "
                f"(each recompile costs compile time again): {why}.{hint}",
                file=sys.stderr,
                flush=True,
            )
        return {
            "compile_s": seconds,
            "recompiles": len(recompiled),
            "graph_breaks": breaks - self._breaks_before,
        }
