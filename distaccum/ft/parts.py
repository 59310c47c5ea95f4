"""The parts a fault-tolerant run adds to the loop: the window cut for the groups a quorum admits, the sum across
groups, and a step computed again when that sum failed.

The window of step s is the global-batch order's (the same samples in the same order as any other run of the global batch G). With
n groups present of R ranks each it is cut as a run of n R ranks would cut it: K = G / (micro x n R) micro-batches per
rank, this rank taking the pieces of rank q R + r (q: its group's place in the quorum, r: its rank in the group). So a
missing group's pieces go to the others (K grows), and every piece is trained exactly once per committed step. A
group that healed in the quorum is not among the n: it runs one stand-in micro-batch of weight 0 and takes the step.

The loop's normalization holds across groups: each group reduces its ranks' gradients and window rows as always,
then ONE collective across the groups present (:meth:`FtTotals.read`) sums the gradients and the rows' totals (N, the
loss sum, the samples, the votes and which groups took part), so the engine's step multiplies by 1/(c N) of the
whole window, exactly as a run without groups does. The sum is a SUM (torchft divides by the groups present by
default). If it failed, or a group voted against the step, the step is not committed: the engine skips the update
(the gradients are dropped), the order's position stays, and :class:`FtRetry` computes the step again under the next
quorum. An engine that sums its gradients itself (exact accumulation's int64 sum) joins the session instead: the
collective then carries the rows' totals only, and the engine votes after its own sum across the groups.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from distaccum.data.pipeline import MicroBatch, OrderPosition, OrderSource, WindowBatches
from distaccum.engines.base import Engine
from distaccum.ft.session import FtSession, Quorum
from distaccum.loop import Step, TrainState
from distaccum.split import Split
from distaccum.telemetry.sinks import Record
from distaccum.window import Carry, WindowResult, WindowTotals


@dataclass
class StepView:
    """What one committed step was, for its record (kept by step: records may be handed over a step late)."""

    quorum: Quorum
    attempts: int = 1
    lost_s: float = 0.0
    """Seconds spent in this step's attempts that were not committed (the failure's recomputed work and stall)."""
    sent_bytes: int = 0
    """Bytes this rank put into reductions across groups in the step, every attempt's."""
    groups: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    """The sample ids this group trained in the step, in the global-batch order."""


class FtSource(OrderPosition):
    """This rank's windows, cut for each step's quorum (a wrapper of the run's :class:`OrderSource`, whose order it
    shares; its position advances only when the step was committed)."""

    def __init__(self, inner: OrderSource, session: FtSession, group_rank: int, group_world: int) -> None:
        self.inner, self.session = inner, session
        self.group_rank, self.group_world = group_rank, group_world
        self.order = inner.order
        self._source: OrderSource = inner
        self._cut: tuple[Split, int] = (inner.split, inner.rank)
        self.views: dict[int, StepView] = {}

    @property
    def place(self) -> tuple[int, int]:
        """(world, rank) of the run this step's window was cut as: where this rank's micro-batches sit among the
        window's pieces (exact accumulation seeds and places its pieces by it)."""
        return self._cut[0].world_size, self._cut[1]

    def cut(self, quorum: Quorum) -> tuple[Split, int]:
        """(the split of a run of the groups that take pieces, this rank's place in it)."""
        micro, world = self.inner.split.micro_batch, self.group_world * quorum.groups
        split = Split(micro, self.order.global_batch // (micro * world), world)
        return split, max(quorum.index, 0) * self.group_world + self.group_rank

    def window(self) -> WindowBatches:
        # A healing group loads a live group's state (and data position) in the quorum: the step is read after it.
        quorum = self.session.quorum(self.order.next_step)
        step, cut = self.order.next_step, self.cut(quorum)
        self.session.step = step  # a healing group is at the live groups' step now
        if cut != self._cut or self.session.attempts > 1 or quorum.sits_out:  # a fresh walk
            self._source, self._cut = self._walk(cut), cut
        view = self.views.get(step)
        self.views[step] = StepView(
            quorum, self.session.attempts, view.lost_s if view else 0.0, view.sent_bytes if view else 0
        )
        if quorum.sits_out:
            return self._stand_in(self._source.window())
        if self.session.cfg.sample_ids:
            self.views[step].samples = self._group_samples(step, cut[0], quorum)
        return self._source.window()

    def _walk(self, cut: tuple[Split, int]) -> OrderSource:
        inner = self.inner
        return OrderSource(
            inner.dataset,
            inner.collate,
            self.order,
            cut[0],
            cut[1],
            inner.stop,
            float_dtype=inner.float_dtype,
            **inner.loader_options,
        )

    def _stand_in(self, window: WindowBatches) -> WindowBatches:
        """A group that sits the step out (it healed in the quorum) takes no pieces: one stand-in micro-batch of
        weight 0 (samples 0, as for an empty piece) keeps its collectives and its optimizer step in line with the
        others', its gradient zeros in the sum."""
        first = next(window.micro)
        split = Split(window.split.micro_batch, 1, self.group_world)
        return replace(window, micro=iter([MicroBatch(first.batch, 0)]), split=split)

    def _group_samples(self, step: int, split: Split, quorum: Quorum) -> list[int]:
        first = quorum.index * self.group_world
        ids: list[int] = []
        for r in range(first, first + self.group_world):
            ids += torch.cat(self.order.rank_pieces(step, split, r)[1]).tolist()
        return ids

    def advance(self) -> None:
        if self.session.committed:
            self._source.advance()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class Uncommitted(WindowResult):
    """The totals of a step that was not committed: its gradient is dropped on every engine (NaN scale: the step is
    skipped and the gradients zeroed, as for a non-finite loss)."""

    def grad_scale(self, c: float, loss_norm: str = "global_count") -> float:
        return math.nan


class FtTotals:
    """The window's totals of this group (its own collective, :class:`WindowTotals`), then ONE collective across the
    groups present: the gradients and the totals summed, and the commit vote."""

    def __init__(self, inner: WindowTotals, session: FtSession, engine: Engine, source: FtSource) -> None:
        self.inner, self.session, self.engine, self.source = inner, session, engine, source
        self._result: WindowResult | None = None

    def start(self) -> None:
        self.inner.start()
        self._result = None

    def add(self, summed: torch.Tensor, n_items: Any, samples: int) -> float:
        return self.inner.add(summed, n_items, samples)

    def reduce(self, *, stop: bool, checkpoint: bool, carry: Carry | None = None) -> None:
        self.inner.reduce(stop=stop, checkpoint=checkpoint, carry=carry)

    def read(self) -> WindowResult:
        if self._result is None:
            self._result = self._across(self.inner.read())
        return self._result

    def _across(self, mine: WindowResult) -> WindowResult:
        session, groups = self.session, self.session.cfg.groups
        own = session.engine_sums  # the engine sums the gradients across groups and votes after (accum.exact)
        grads = [] if own else [g.to_local() if hasattr(g, "to_local") else g for g in self._grads()]
        present = [0.0] * groups  # the groups that took pieces (a group that sits the step out sends zeros)
        present[session.group] = 0.0 if session.last is not None and session.last.sits_out else 1.0
        row = [
            mine.items,
            mine.loss_sum,
            float(mine.samples),
            float(mine.stop_votes),
            float(mine.checkpoint_votes),
        ]
        device = grads[0].device if grads else torch.device("cpu")
        # One buffer, float64: gradients widen exactly, and the totals stay exact (integer counts below 2^53).
        flat = torch.cat(
            [
                *(g.reshape(-1).to(torch.float64) for g in grads),
                torch.tensor(row + present, dtype=torch.float64, device=device),
            ]
        )
        session.all_reduce(flat, "sum")
        sums, at = flat[-(len(row) + groups) :].tolist(), 0
        for g in grads:
            g.copy_(flat[at : at + g.numel()].view_as(g))
            at += g.numel()
        committed = own or session.vote()  # an engine that sums itself votes after its sum
        step = self.source.views.get(session.step)
        if step is not None:
            step.groups = [i for i in range(groups) if sums[len(row) + i] > 0.5]
        total = replace(
            mine,
            items=sums[0],
            loss_sum=sums[1],
            samples=round(sums[2]),
            stop_votes=round(sums[3]),
            checkpoint_votes=round(sums[4]),
        )
        return (
            total if committed else Uncommitted(**{f: getattr(total, f) for f in total.__dataclass_fields__})
        )

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.engine.unwrapped().parameters() if p.grad is not None]


class FtRetry:
    """Runs each step until it is committed: a step whose reduction across groups failed (or that a group voted
    against) is computed again, from the same window, under the next quorum; a redo (``accum.exact``: a piece outgrew
    the scale, no vote taken) runs the window again under the same quorum, as every group does."""

    def __init__(self, session: FtSession, source: FtSource, engine: Engine, state: TrainState) -> None:
        self.session, self.source, self.engine, self.state = session, source, engine, state
        self._totals: dict[int, FtTotals] = {}

    def __call__(self, attempt: Callable[[Any], Step], totals: WindowTotals) -> Step:
        wrapped = self._totals.get(id(totals))
        if wrapped is None:
            wrapped = self._totals[id(totals)] = FtTotals(totals, self.session, self.engine, self.source)
        while True:
            began, n_prev, sent = time.perf_counter(), self.state.n_prev, self.session.sent_bytes
            done = attempt(wrapped)
            view = self.source.views[done.window.step]
            view.sent_bytes += self.session.sent_bytes - sent
            if done.result.redo:
                self.session.redoing = True
                continue
            if self.session.committed:
                return done
            # c = 2^-round(log2 N_prev) must be the same in every group (their gradients are summed): an uncommitted
            # step's N (a partial sum, or another quorum's) never becomes N_prev.
            self.state.n_prev = n_prev
            view.lost_s += time.perf_counter() - began


class FtRecord:
    """Each step's record fields (a :class:`~distaccum.loop.StepMonitor`): the groups present, K (``micro_steps``,
    already in the record) and this group's share."""

    def __init__(self, session: FtSession, source: FtSource) -> None:
        self.session, self.source = session, source

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None:
        return None

    def fields(self, record: Record, times: Any, records: list[Record]) -> Record:
        view = self.source.views.pop(int(record["step"]) - 1, None)
        if view is None:
            return {}
        return (
            {
                "ft_group": self.session.group,
                "ft_groups": view.groups,
                "ft_attempts": view.attempts,
                "ft_lost_s": view.lost_s,
                "ft_bytes": view.sent_bytes,
                "ft_quorum_s": view.quorum.quorum_s,
                "ft_healed": view.quorum.healed,
            }
            | ({"ft_sample_ids": view.samples} if self.session.cfg.sample_ids else {})
            | self._sat_out(view)
        )

    def _sat_out(self, view: StepView) -> Record:
        """A step this group sat out (it healed in its quorum): the run's global batch, and no pieces (K = 0; its
        one stand-in micro-batch of weight 0 is no piece)."""
        return (
            {"global_batch": self.source.order.global_batch, "micro_steps": 0} if view.quorum.sits_out else {}
        )
