"""The per-step reduction fingerprint: after every boundary reduction the ranks compare a sample of the reduced
gradient, carried by the next window's collective.

After a correct all-reduce every rank holds the same bytes of the reduced gradient. The engine's step takes two
numbers of a fixed sample of it before normalizing (:class:`~distaccum.engines.base.GradSample`: about 4096 elements,
the first of every tensor included; its position-weighted sum and its sum of squares: two operations a step), and
each rank's pair rides on the next window's collective (:class:`~distaccum.window.Carry`), so they are compared one
step later, when that window's totals are read, without a collective or a wait of their own. Any difference means
the reduction went wrong: a rank skipped it, ``no_sync`` sat on the wrong micro-batch, DDP's ``static_graph``
stopped reducing, buckets were mismatched. The run then stops **one step later**, before that step's record, with
:class:`~distaccum.guards.tripwire.RankDivergenceError` (exit 1), naming the step, the ranks that disagree and the
first parameter whose update differs (found by a second all-gather of per-parameter digests, only then); rank 0
writes ``divergence.json`` as the tripwire does, so ``distaccum verify`` reports it the same way. Before a
checkpoint, a tripwire check and at the run's end the pending comparison is gathered at once (one all-gather), so no
checkpoint or final model is written after a diverged step.

Engines whose reduced gradient is replicated on every rank (``replicated_gradients``: DDP, Accelerate) send that
sample. Sharded engines (FSDP2, HSDP, DeepSpeed ZeRO 1-3) keep each reduced element once per replica, so there is
no second copy to compare (ZeRO-0, which all-reduces, takes the same path, each rank a replica); they send their :class:`~distaccum.guards.checksum.ReductionChecksum` instead: the
verdict of the reduced sample it holds against the ranks' local gradients summed exactly (one all-reduce of the
sample in the engine's step): every sampled element must stay within the reduction's own rounding bound (the
invariant and the bound are in :mod:`distaccum.guards.checksum`); a skipped, doubled or mis-scaled reduction stops
the run the same way, one step later, with ``divergence.json``.

Two warnings come from the same rows (stderr and ``warnings.jsonl``, rank 0, once per kind):

- ``same_samples``: every rank's window had the same loss sum over the same item count: the ranks probably read
  the same samples (a sampler that ignores the rank; a dataset of repeated samples could do it too).
- ``same_rng``: every rank's random-number generator was last seeded with the same seed (a CRC32 of it is
  carried): the ranks draw the same dropout masks (someone re-seeded every rank alike).

World size 1 has nothing to compare and skips everything.
"""

from __future__ import annotations

import functools
import json
import math
import struct
import sys
import zlib
from pathlib import Path
from typing import Any, Protocol

import torch

from distaccum.guards.agreement import all_same, gather, groups, same
from distaccum.guards.checksum import agree
from distaccum.guards.tripwire import RankDivergenceError
from distaccum.rundir import DIVERGENCE, WARNINGS
from distaccum.runtime.procgroup import collective_device
from distaccum.window import Carry, WindowResult


class Reduced(Protocol):
    """What the fingerprint reads of a step (:class:`~distaccum.engines.base.StepResult`)."""

    @property
    def grad_sample(self) -> torch.Tensor | None: ...

    @property
    def grad_sums(self) -> torch.Tensor | None: ...


def rng_hash(device: torch.device) -> float:
    """A CRC32 of the seed the random-number generator was last seeded with (CPU, and CUDA on CUDA), as an
    exact float. The seed, not the state: ranks seeded alike draw the same stream, but consume different
    amounts of it (dropout on sequences of different lengths), so their states part while their masks
    overlap."""
    return _seed_hash(
        (torch.initial_seed(), *((torch.cuda.initial_seed(),) if device.type == "cuda" else ()))
    )


@functools.lru_cache(maxsize=16)
def _seed_hash(seeds: tuple[int, ...]) -> float:
    """The hash of the seeds, made once per seed (the same seeds come back every step)."""
    return float(zlib.crc32(struct.pack(f"<{len(seeds)}Q", *(seed % 2**64 for seed in seeds))))


class Fingerprint:
    """The check the loop hands each step to after the optimizer step: it keeps this rank's row (the seed hash and
    the step's gradient sample), hands it to the next window's collective (:meth:`carry`) and compares every rank's
    once that window is read (:meth:`judge`), or at once (:meth:`flush`). Collective: every rank calls it at
    every step."""

    def __init__(
        self, engine: Any, run_dir: Path, rank: int, world_size: int, device: torch.device, group: Any = None
    ) -> None:
        self.engine, self.run_dir, self.rank, self.world, self.device = (
            engine,
            run_dir,
            rank,
            world_size,
            device,
        )
        self.group = group
        """The group the ranks it compares share (None: the world; an outer-synced run's island)."""
        self.gradients = bool(getattr(engine, "replicated_gradients", False))
        """Compare the replicated gradient's sample (else: check the sharded engine's reduction checksum)."""
        self.warned: set[str] = set()
        self._pending: tuple[int, Carry] | None = None
        """(step, this rank's row) taken after a step and not compared yet."""
        self._carried: int | None = None
        """The step whose row the window in flight carries."""

    def carry(self) -> Carry | None:
        """The row the window's collective carries: the previous step's (None: nothing pending)."""
        if self._pending is None:
            return None
        self._carried = self._pending[0]
        return self._pending[1]

    def judge(self, step: int, window: WindowResult, result: Reduced) -> None:
        """Compare the previous step's rows, which this window carried; check this window's data; keep this step's
        row for the next window."""
        if self.world == 1:
            return
        if self._carried is not None and self._pending is not None:
            self._judge(self._carried, window.carried)
            self._pending = self._carried = None
        self._check_data(step, window)
        sample = result.grad_sample if self.gradients else result.grad_sums
        self._pending = (step, Carry([rng_hash(self.device)], sample))

    def flush(self) -> None:
        """Compare the pending row now, gathered with one all-gather of its own (before a checkpoint, a tripwire check
        and at the run's end). Collective: every rank's loop calls it at the same step."""
        if self._pending is None:
            return
        step, carry = self._pending
        self._pending = self._carried = None
        local = torch.tensor(carry.floats, dtype=torch.float64, device=collective_device())
        if carry.tensor is not None:
            local = torch.cat([local, carry.tensor.to(local.device)])
        self._judge(step, self._gather(local))

    def _gather(self, local: torch.Tensor) -> list[list[float]]:
        """Every rank's ``local`` (one all-gather, collective) as rows on the host."""
        return gather(local, group=self.group, device=collective_device()).tolist()

    def _judge(self, step: int, rows: list[list[float]]) -> None:
        if self.gradients and not all_same([row[1:] for row in rows]):
            self._fail(step, rows)
        if not self.gradients and all(len(row) == 4 for row in rows):
            self._check_sums(step, [row[1:] for row in rows])
        if all_same([row[:1] for row in rows]):
            self._warn(
                step,
                "same_rng",
                f"every rank's random-number generator was last seeded with the same seed (optimizer step "
                f"{step}): the ranks draw the same random numbers (the same dropout masks on different "
                "samples). Something re-seeded every rank alike; seed each rank differently (distaccum's "
                "Trainer does: trainer.seed + a rank offset)",
            )

    def _check_data(self, step: int, window: WindowResult) -> None:
        data = [list(pair) for pair in window.rank_sums]
        if data[0][1] > 0 and all(math.isfinite(x) for x in data[0]) and all_same(data):
            self._warn(
                step,
                "same_samples",
                f"every rank trained on identical data at optimizer step {step} (the same loss sum "
                f"{data[0][0]:.9g} over the same {data[0][1]:.0f} loss items on all {self.world} ranks): the "
                "ranks are probably reading the same samples (a sampler or dataset that ignores the rank), "
                "so the effective batch is 1/world of what it should be",
            )

    def _warn(self, step: int, check: str, message: str) -> None:
        if check in self.warned:
            return
        self.warned.add(check)
        if self.rank == 0:
            print(f"distaccum: warning: {message}", file=sys.stderr, flush=True)
            with open(self.run_dir / WARNINGS, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "check": check, "message": message}) + "\n")

    def _check_sums(self, step: int, sums: list[list[float]]) -> None:
        """The sharded invariant: every replica's sampled reduced elements equal the ranks' local gradients summed
        exactly, each within its rounding bound (:mod:`distaccum.guards.checksum`)."""
        replicas = self.engine.checksum.replicas
        ok, ratios, worst = agree(sums, replicas)
        if ok:
            return
        bad = next(i for i, share in enumerate(worst) if not share <= 1.0)
        ranks = replicas[bad]
        where = f" of replica {bad} (ranks {', '.join(map(str, ranks))})" if len(replicas) > 1 else ""
        a = math.fsum(sums[r][0] for r in ranks)
        message = (
            f"the gradient reduction went wrong at optimizer step {step}: the reduced gradient{where} is "
            f"{ratios[bad]:.6g} x what the ranks' local gradients add up to (reduction checksum: local "
            f"{a:.9g}, reduced {a * ratios[bad]:.9g}; its worst sampled element is {worst[bad]:.3g} x the "
            "rounding bound a correct reduction never leaves). 0 means the reduction was skipped, 2 that it ran "
            "twice; another number, that it was scaled wrongly or some rank's part is missing or extra (a no_sync "
            "that never re-enables sync, a reduction skipped or repeated, a wrong divide factor). The run stopped "
            "when the comparison was read: one step later, or at once before a checkpoint or at the end of the run."
        )
        self._stop(step, "(reduction checksum)", ranks, message, ratio=ratios[bad], bound_share=worst[bad])

    def _fail(self, step: int, rows: list[list[float]]) -> None:
        by_gradient = groups([row[1:] for row in rows])
        agree, odd = by_gradient[0], sorted(r for g in by_gradient[1:] for r in g)
        named = list(self.engine.unwrapped().named_parameters())
        # Read after the step (the verdict waits for it): the gradients are gone, the parameters they moved
        # differently are not. The first parameter whose update differs is the first whose gradient did.
        local = (
            torch.stack(
                [
                    torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                    for _, p in named
                ]
            )
            if named
            else torch.zeros(0, 2, dtype=torch.float64)
        )
        per_rank = [torch.tensor(r, dtype=torch.float64).view(-1, 2) for r in self._gather(local.flatten())]
        base = per_rank[agree[0]]
        differ = [
            i
            for i in range(len(named))
            if any(
                not all(same(a, b) for a, b in zip(per_rank[r][i].tolist(), base[i].tolist(), strict=True))
                for r in odd
            )
        ]
        parameter = named[differ[0]][0] if differ else "(a sampled element only)"
        message = (
            f"ranks disagree on the reduced gradient at optimizer step {step}: rank(s) {', '.join(map(str, odd))} "
            f"differ from rank(s) {', '.join(map(str, agree))} (reduction fingerprint); first differing "
            f"parameter {parameter!r} ({len(differ)} of {len(named)} parameters differ). The gradients were "
            "not reduced identically on every rank (a rank skipped or missed the reduction, no_sync on the "
            "wrong micro-batch, a comm hook that keeps local values, DDP static_graph with no_sync). The "
            "run stopped when the comparison was read: one step later, or at once before a checkpoint or at the "
            "end of the run."
        )
        self._stop(step, parameter, odd, message, differing_parameters=len(differ))

    def _stop(self, step: int, parameter: str, ranks: list[int], message: str, **extra: Any) -> None:
        """Write the divergence report (rank 0) and stop the run naming the step, the parameter and the ranks."""
        if self.rank == 0:
            report = {"step": step, "parameter": parameter, "rank": ranks[0], "ranks": ranks, **extra}
            report.update(check="fingerprint", message=message)
            (self.run_dir / DIVERGENCE).write_text(json.dumps(report, indent=2) + "\n")
        raise RankDivergenceError(message, step=step, parameter=parameter, rank=ranks[0])
