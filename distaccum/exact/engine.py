"""The engine of an exact run: it drives the run's own engine (DDP, FSDP2) and replaces its reduction with the
fixed-point one.

Every piece's forward and backward run under the engine's ``no_sync`` (DDP never reduces a float gradient; FSDP2
keeps the unsharded local gradient and never reduce-scatters it), with torch's generator seeded by the piece's index
in the window, so its dropout masks are the same for every split. After each backward the piece is folded into the
int64 accumulator (:class:`~distaccum.exact.fixed_point.FixedPoint`); at the step the accumulators are summed (an
int64 all-reduce; for FSDP2 an int64 reduce-scatter into each rank's gradient shards), the sum converted into the
gradients, and the engine's own step normalizes (x 1/(c N)), clips and steps them as in every run. A piece that
outgrew the scale makes the step a redo (:attr:`~distaccum.engines.base.StepResult.redo`): the loop runs the same
window again.

Across fault-tolerant replica groups (``ft.groups``) the run's pieces are cut for the groups each step's quorum
admits: this rank's place among the window's pieces is the cut's (``place_of``), so a piece keeps its index, samples
and seed whoever computes it. The maximum and the int64 sum cross the groups after the group's own
(:class:`AcrossGroups`), and the step counts only if every group then votes for it: the commit comes after the exact
sum, never before. A step that does not count applies nothing and puts the scale back to the last counted step's (a
failed attempt's maximum may be partial), so the attempt that counts scales its pieces as a run without failures
does; a redo stays in the step's quorum (it opens none) and is voted on with the pass that sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ContextManager, Protocol

import torch
from torch import nn

from distaccum.engines.base import Engine, OptimizerFactory, StepResult
from distaccum.exact.fixed_point import FixedPoint, Outcome


def piece_seed(seed: int, step: int, piece: int) -> int:
    """The generator's seed for piece ``piece`` of 0-based step ``step`` (a function of nothing else)."""
    return ((seed * 1_000_003 + step) * 2**20 + piece) % 2**63


class AcrossGroups(Protocol):
    """The sum across fault-tolerant replica groups that an engine summing its own gradients joins (``ft.groups``:
    :class:`~distaccum.ft.session.FtSession`)."""

    def join(self, state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        """The engine sums the gradients across groups and votes itself (the window's totals then only sum their
        row); ``state()`` travels with the model to a group that heals, which ``load``s it."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """``tensor`` reduced (``"sum"``, ``"max"``) over the groups present, in place; a failure is recorded and
        fails the vote."""
        ...

    def vote(self) -> bool:
        """Whether the step counts (every group present votes; False: it is computed again)."""
        ...


class ExactEngine:
    """An :class:`~distaccum.engines.base.Engine` around ``inner`` (DDP, FSDP2) whose gradients are summed in fixed point.

    ``place_of()`` is (world, rank) of the split this rank's window was cut for, which places its micro-batch m at
    piece m x world + rank (``world`` and ``rank`` until the set-up says otherwise); ``step_of()`` is the 0-based
    step the loop is running (the window source's position, set by the set-up once the state exists). ``across``:
    the replica groups' sum, joined (:class:`AcrossGroups`)."""

    def __init__(
        self,
        inner: Engine,
        *,
        world: int,
        rank: int,
        seed: int,
        group: Any = None,
        across: AcrossGroups | None = None,
    ) -> None:
        self.inner = inner
        self.seed, self.group, self.across = seed, group, across
        self.place_of: Callable[[], tuple[int, int]] = lambda: (world, rank)
        self.step_of: Callable[[], int] = lambda: 0
        self.fixed: FixedPoint | None = None
        self._micro = 0
        """Micro-batches of this pass so far (a redo starts again at 0)."""
        self._place = (world, rank)
        """This pass's (world, rank)."""
        self._counted: dict[str, Any] = {}
        """The scale after the last step that counted (what a step that did not count goes back to)."""
        if across is not None:
            across.join(lambda: dict(self._counted), self._restore)

    # What the loop uses, changed.
    grad_divisor = 1.0
    """The fixed-point sum is a plain sum; the step's 1/(c N) stays the only normalization."""
    grad_squares = None

    def _fixed(self) -> FixedPoint:
        assert self.fixed is not None, "wrap() first"
        return self.fixed

    def wrap(self, model: nn.Module, make_optimizer: OptimizerFactory) -> nn.Module:
        wrapped = self.inner.wrap(model, make_optimizer)
        params = self.inner.local_gradients()  # type: ignore[attr-defined]  # engines with exact_accumulation
        self.fixed = FixedPoint(params, params[0].device, self.group)
        self._counted = self.fixed.state()
        return wrapped

    def _restore(self, state: dict[str, Any]) -> None:
        """The scale of a counted step (a checkpoint's, a live group's)."""
        self._fixed().load(state)
        self._counted = self._fixed().state()

    def sync(self, enabled: bool) -> ContextManager[object]:
        """Never the engine's own reduction; the piece's random draws seeded by its index in the window."""
        if self._micro == 0:
            self._fixed().attach()
            self._place = self.place_of()
        world, rank = self._place
        torch.manual_seed(piece_seed(self.seed, self.step_of(), self._micro * world + rank))
        self._micro += 1
        return self.inner.sync(False)

    def forward_context(self) -> ContextManager[object]:
        return self.inner.forward_context()

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)
        self._fixed().add_piece()

    def step(self, max_norm: float | None, grad_scale: float) -> StepResult:
        self._micro = 0
        shards = None if self.inner.replicated_gradients else self.inner.gradient_shards()  # type: ignore[attr-defined]
        fixed = self._fixed()
        outcome = fixed.reduce(getattr(self.inner, "ledger", None), shards, self.across)  # collective
        if outcome is Outcome.REDO:
            return StepResult(None, applied=False, redo=True)
        if self.across is not None and not self.across.vote():
            # This attempt's maximum may be partial: the last counted step's scale (its passes still counted).
            fixed.load({**self._counted, "redos": fixed.redos})
            return self.inner.step(max_norm, math.nan)  # nothing applied, the gradients dropped
        self._counted = fixed.state()
        return self.inner.step(max_norm, grad_scale if outcome is Outcome.SUMMED else math.nan)

    def save_state(self, directory: Path) -> dict[str, Any]:
        return {**self.inner.save_state(directory), "exact": self._fixed().state()}

    def load_state(self, directory: Path, extra: dict[str, Any]) -> None:
        self.inner.load_state(directory, extra)
        self._restore(extra.get("exact") or {})

    # The rest is the engine's own.
    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def replicated_gradients(self) -> bool:
        return self.inner.replicated_gradients

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.inner.optimizer

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.inner.full_parameters()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.full_state_dict()

    def unwrapped(self) -> nn.Module:
        return self.inner.unwrapped()

    def teardown(self) -> None:
        self.inner.teardown()

    def layout(self) -> list[list[int]] | None:
        return self.inner.layout()

    def reduction_rounds(self, accum_steps: int | None = None) -> tuple[int, int] | None:
        return self.inner.reduction_rounds(accum_steps)

    def __getattr__(self, name: str) -> Any:  # spec, ledger, device, ...: the engine's
        return getattr(self.inner, name)
