"""Cross-rank consistency tripwire: after a boundary step every rank must hold the same parameters.

A misplaced ``no_sync`` (or a rank that skipped the reduction) leaves ranks training different
models while losses still look plausible. Each rank computes a fp64 (sum, sum of squares) per
parameter — 2 numbers per tensor — and one all-gather compares them with rank 0's.

Cost (measured, see docs/verify.md): one all-gather of 16 bytes per parameter tensor plus one fp64
pass over the parameters; for ``full_parameters()`` of a sharded engine (FSDP) it is also an
all-gather of the whole model, which is why training checks only every ``trainer.check_every`` steps.

``distaccum verify`` also asks every run to *record* the parameter digests of each step
(``param_digests.jsonl``, rank 0) so a mismatch with the reference can be located to the first step
and parameter; a world-size-1 run records without comparing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from distaccum.rundir import DIVERGENCE, PARAM_DIGESTS
from distaccum.runtime.procgroup import collective_device, gather_rows
from distaccum.window import WindowResult


class Parameters(Protocol):
    """What the tripwire reads of an engine (:class:`~distaccum.engines.base.Engine`): the full parameters."""

    def full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...


class PendingCheck(Protocol):
    """A check whose comparison may still be pending (the reduction fingerprint): :meth:`flush` makes it now."""

    def flush(self) -> None: ...


class RankDivergenceError(RuntimeError):
    """Ranks hold different parameters after an optimizer step."""

    def __init__(self, message: str, *, step: int, parameter: str, rank: int) -> None:
        super().__init__(message)
        self.step = step
        self.parameter = parameter
        self.rank = rank

    def __reduce__(self) -> tuple[object, ...]:  # picklable despite keyword-only fields
        return (_rebuild_divergence, (str(self), self.step, self.parameter, self.rank))


def _rebuild_divergence(message: str, step: int, parameter: str, rank: int) -> RankDivergenceError:
    return RankDivergenceError(message, step=step, parameter=parameter, rank=rank)


def parameter_digests(
    named: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[int], torch.Tensor]:
    """Names, element counts and a [P, 2] fp64 tensor of (sum, sum of squares) per full parameter.

    The tensor stays on the parameters' device; the caller moves it once (no per-parameter sync).
    """
    names: list[str] = []
    numels: list[int] = []
    rows: list[torch.Tensor] = []
    for name, tensor in named:
        t = tensor.detach().to(torch.float64)
        names.append(name)
        numels.append(t.numel())
        rows.append(torch.stack([t.sum(), (t * t).sum()]))
    if not rows:
        return names, numels, torch.zeros(0, 2, dtype=torch.float64)
    return names, numels, torch.stack([r.to(rows[0].device) for r in rows])


def check_consistency(
    engine: Parameters, step: int, run_dir: Path | None = None, *, record: bool = False, group: Any = None
) -> None:
    """Raise :class:`RankDivergenceError` naming the step and parameter if ranks disagree.

    With ``run_dir``, rank 0 also writes ``divergence.json`` there before raising, and with
    ``record`` appends this step's parameter digests to ``param_digests.jsonl`` (used by ``distaccum verify``).
    Collective: every rank of ``group`` (None: the world; an outer-synced run's island, whose parameters differ
    from the other islands' between syncs) must call it at the same step.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1 and not record:
        return
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    names, numels, local = parameter_digests(engine.full_parameters())
    if world > 1:
        local = local.to(collective_device())
        gathered = gather_rows(local, group=group, device=local.device).view(world, len(names), 2)
        _compare_ranks(names, list(gathered), step, run_dir if rank == 0 else None)
    world_rank = dist.get_rank() if dist.is_initialized() else 0  # island 0's first rank records
    if record and world_rank == 0 and run_dir is not None:
        append_digests(run_dir, step, names, numels, local)


def append_digests(
    run_dir: Path, step: int, names: list[str], numels: list[int], values: torch.Tensor
) -> None:
    """Append one step's parameter digests to ``param_digests.jsonl`` (the format ``distaccum verify`` reads)."""
    rows = values.cpu().tolist()
    row = {"step": step, "params": {n: [s, q, c] for n, (s, q), c in zip(names, rows, numels, strict=True)}}
    with open(run_dir / PARAM_DIGESTS, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def _compare_ranks(
    names: list[str], gathered: list[torch.Tensor], step: int, report_dir: Path | None
) -> None:
    reference = gathered[0]
    for rank, other in enumerate(gathered[1:], start=1):
        # Reduced gradients are bitwise identical on every rank, so parameters must be too.
        bad = (other != reference).any(dim=1).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            message = (
                f"ranks diverged after optimizer step {step}: parameter {names[i]!r} has digest "
                f"{other[i].tolist()} on rank {rank} but {reference[i].tolist()} on rank 0 "
                f"({len(bad)} of {len(names)} parameters differ). Gradients were not reduced "
                "identically on every rank (misplaced no_sync, a skipped reduction, or rank-dependent code)."
            )
            if report_dir is not None:
                report = {
                    "step": step,
                    "parameter": names[i],
                    "rank": rank,
                    "differing_parameters": len(bad),
                    "message": message,
                }
                (report_dir / DIVERGENCE).write_text(json.dumps(report, indent=2) + "\n")
            raise RankDivergenceError(message, step=step, parameter=names[i], rank=rank)


def read_divergence(run_dir: Path) -> dict[str, object] | None:
    """The tripwire's report from a run directory, or None when it did not fire."""
    path = run_dir / DIVERGENCE
    return json.loads(path.read_text()) if path.is_file() else None


class Tripwire:
    """The cross-rank consistency check every ``every`` optimizer steps (after steps 1, every + 1, ...), a
    :class:`~distaccum.loop.StepMonitor`. With ``record`` it also writes every checked step's parameter digests
    (``distaccum verify`` runs with ``every=1`` and ``record``). Its check waits for every rank anyway, so the
    reduction checks handed in as ``first`` (the fingerprint, whose comparison is otherwise read a step later)
    are judged for this step just before it: a broken reduction is reported as such, at its own step."""

    def __init__(
        self,
        engine: Parameters,
        every: int,
        run_dir: Path,
        *,
        record: bool,
        first: Sequence[PendingCheck] = (),
        group: Any = None,
    ) -> None:
        self.engine, self.every, self.run_dir, self.record = engine, every, run_dir, record
        self.first = list(first)
        self.group = group
        """The ranks compared (None: the world; an outer-synced run's island)."""

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None:
        if self.every and (step - 1) % self.every == 0:
            for check in self.first:
                check.flush()
            check_consistency(self.engine, step, self.run_dir, record=self.record, group=self.group)

    def fields(
        self, record: dict[str, object], times: object, records: list[dict[str, object]]
    ) -> dict[str, object]:
        return {}
