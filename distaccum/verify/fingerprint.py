"""The per-step reduction fingerprint: after every boundary reduction, before the optimizer uses it, the
ranks compare a few numbers, carried by the next window's collective.

Per optimizer step every rank contributes :data:`FIELDS` (float64):

The numbers are taken right after the reduction and sent with the next window's item-count collective (in
each rank's slot of :meth:`~distaccum.window.WindowTotals.carry`: an exact all-gather that costs no collective of
its own), so they are compared one step later, when that window's totals are read. A separate all-gather per
step cost its launch, the process group's worker waking up and its own host read even when asynchronous
(``fingerprint on / off`` 1.083 at 0.9M parameters, K = 1, on this project's 2-core machine; 1.024 carried,
within the spread), and waiting for it at once made every rank wait for the slowest after every step (1.125).
The steps no window carried yet are gathered at once (one all-gather) before a
checkpoint, a tripwire check and at the run's end, so a mismatch stops the run at the next step, naming the step
that went wrong, and no checkpoint or final model is written after it.

- ``grad_weighted``, ``grad_sumsq``: a sample of the reduced gradient (about :data:`SAMPLE` elements in runs
  of :data:`RUN`, the first element of every tensor included) — its position-weighted sum and its sum of
  squares. A reduced gradient is bitwise identical on every rank (an all-reduce hands every rank the
  same bytes), so any difference means the reduction went wrong: a rank skipped it, ``no_sync`` sat on
  the wrong micro-batch, DDP's ``static_graph`` stopped reducing, buckets were mismatched. The run stops
  **one step later**, before that step's record, with :class:`~distaccum.verify.tripwire.RankDivergenceError` (exit 1),
  naming the step, the ranks that disagree and the first parameter whose gradient differs (found by a
  second all-gather, only then); rank 0 writes ``divergence.json`` as the tripwire does, so ``distaccum
  verify`` reports it the same way. Only engines whose reduced gradient is replicated on every rank have
  this part (``engine.replicated_gradients``: DDP, Accelerate). FSDP2 and DeepSpeed ZeRO keep each
  reduced gradient shard exactly once (reduce-scatter, partitions): there is no second copy to compare,
  so they send zeros here; the periodic tripwire still compares the parameters they replicate.
- ``loss_sum``, ``items``: this rank's window. Equal on every rank means every rank trained on the same
  samples (a sampler that ignores the rank) — a warning, since a dataset of repeated samples could do it.
- ``rng``: a CRC32 of the seed this rank's random-number generator(s) were last seeded with. Equal on
  every rank means every rank draws from the same stream: the same dropout masks (someone re-seeded every
  rank alike) — a warning.

Warnings go to stderr and ``warnings.jsonl`` (rank 0, once per kind). World size 1 has nothing to
compare and skips everything. Cost per step: one gather of a ~4k-element sample and 5 numbers per rank more in
the next window's collective, read with its totals (``trainer.fingerprint=false`` turns it off); measured by the
benchmark's ``distaccum_no_fingerprint`` variant (BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import json
import math
import struct
import sys
import weakref
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from distaccum.cluster.procgroup import all_gather_flat, collective_device
from distaccum.rundir import DIVERGENCE, WARNINGS
from distaccum.verify.tripwire import RankDivergenceError

FIELDS = ("grad_weighted", "grad_sumsq", "loss_sum", "items", "rng")
SAMPLE = 4096
"""Gradient elements sampled per step (about; the first element of every tensor included)."""
RUN = 16
"""The sample's consecutive elements per pick (64 bytes of fp32: one cache line)."""


def rng_hash(device: torch.device) -> float:
    """A CRC32 of the seed the random-number generator was last seeded with (CPU, and CUDA on CUDA), as an
    exact float. The seed, not the state: ranks seeded alike draw the same stream, but consume different
    amounts of it (dropout on sequences of different lengths), so their states part while their masks
    overlap."""
    return _seed_hash((torch.initial_seed(), *((torch.cuda.initial_seed(),) if device.type == "cuda" else ())))


@functools.lru_cache(maxsize=16)
def _seed_hash(seeds: tuple[int, ...]) -> float:
    """The hash of the seeds, made once per seed (the same seeds come back every step)."""
    return float(zlib.crc32(struct.pack(f"<{len(seeds)}Q", *(seed % 2**64 for seed in seeds))))


_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def sample_views(grads: list[torch.Tensor], sample: int = SAMPLE, run: int = RUN) -> list[torch.Tensor]:
    """About ``sample`` elements of the gradients, as views: runs of ``run`` consecutive elements (one cache line
    of fp32) evenly spaced through each gradient, the first element of every tensor included (single elements
    picked at a stride would touch a cache line each). Views of
    contiguous gradients stay valid while the gradients do: DDP's bucket views, zeroed in place, are the same
    tensors every step, so :class:`Fingerprint` makes them once."""
    stride = max(run, sum(g.numel() for g in grads) * run // sample)
    views = []
    for g in grads:
        flat = g.reshape(-1)
        rows = flat.numel() // stride
        if rows:
            views.append(flat[:rows * stride].view(rows, stride)[:, :run])
        else:  # smaller than the spacing: its first run (all of it when shorter)
            views.append(flat[:run].view(1, run) if flat.numel() >= run else flat)
    return views


def gradient_sample(grads: list[torch.Tensor], sample: int = SAMPLE, *,
                    views: list[torch.Tensor] | None = None) -> torch.Tensor:
    """[position-weighted sum, sum of squares] of :func:`sample_views` of the gradients (fp64); ``views``: made
    earlier."""
    views = views if views is not None else sample_views(grads, sample)
    if not views:
        return torch.zeros(2, dtype=torch.float64)
    runs = [v for v in views if v.dim() == 2]  # (picks, RUN) each: one cat, no copy per tensor
    parts = ([torch.cat(runs).view(-1)] if runs else []) + [v for v in views if v.dim() == 1]
    flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).to(torch.float64)
    # Position-dependent weights: two tensors' gradients swapped between ranks change the sum. The same
    # sizes come back every step: the weights are made once.
    key = (flat.numel(), flat.device)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = torch.linspace(1.0, 2.0, flat.numel(), dtype=torch.float64, device=flat.device)
    return torch.stack([torch.dot(flat, _WEIGHTS[key]), torch.dot(flat, flat)])


def same(a: float, b: float) -> bool:
    """Bitwise-style equality of two gathered numbers (NaN equals NaN: a non-finite step is alike everywhere)."""
    return a == b or (math.isnan(a) and math.isnan(b))


def all_same(rows: list[list[float]]) -> bool:
    """Whether every row equals the first (:func:`same` numbers): the common verdict, without grouping the ranks."""
    first = rows[0]
    return all(row == first or all(same(x, y) for x, y in zip(first, row, strict=True)) for row in rows[1:])


def groups(rows: list[list[float]]) -> list[list[int]]:
    """Ranks grouped by equal rows, the largest group first (ties: the group of the lowest rank)."""
    found: list[list[int]] = []
    for rank, row in enumerate(rows):
        for group in found:
            if all(same(x, y) for x, y in zip(rows[group[0]], row, strict=True)):
                group.append(rank)
                break
        else:
            found.append([rank])
    return sorted(found, key=lambda g: (-len(g), g[0]))


class Fingerprint:
    """The check the loop hands each step to right after the boundary reduction (a
    :class:`~distaccum.loop.ReductionCheck`). Collective: every rank calls it at every step."""

    def __init__(self, engine: Any, run_dir: Path, rank: int, world_size: int, device: torch.device) -> None:
        self.engine, self.run_dir, self.rank, self.world, self.device = engine, run_dir, rank, world_size, device
        self.gradients = bool(getattr(engine, "replicated_gradients", False))
        self.warned: set[str] = set()
        self._named: list[tuple[str, torch.nn.Parameter]] | None = None
        self._views: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        """(the gradients, :func:`sample_views` of them) once the same contiguous gradients came back a second step."""
        self._seen: list[weakref.ref[torch.Tensor]] = []
        """The last sampled step's gradients, not kept alive."""
        self._pending: list[tuple[int, torch.Tensor | list[float], Callable[[], list[list[float]] | None] | None]] = []
        """(step, this rank's row, the rows of every rank once a window carried it) taken by
        :meth:`after_reduction` and not judged yet."""

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        if self._named is None:  # the engine wraps the model before the first step
            self._named = list(self.engine.unwrapped().named_parameters())
        return self._named

    def _gather(self, local: torch.Tensor | list[float]) -> list[list[float]]:
        """Every rank's ``local`` (one all-gather, collective) as rows on the host."""
        local = (torch.tensor(local, dtype=torch.float64) if isinstance(local, list) else local).to(collective_device())
        out = torch.empty(self.world * local.numel(), dtype=local.dtype, device=local.device)
        all_gather_flat(out, local.contiguous())
        return out.view(self.world, -1).tolist()

    def _sample(self) -> torch.Tensor:
        grads = [p.grad for _, p in self._params() if p.grad is not None]
        cached, views = self._views
        if len(cached) != len(grads) or any(a is not b for a, b in zip(cached, grads, strict=False)):
            views = sample_views(grads)
            # Views keep their gradients' memory alive: kept only for gradients that outlive a step (DDP's bucket
            # views). An engine that frees them (set to None by zero_grad: Accelerate) gets new ones each step,
            # and a cache would hold the last step's beside them through the next backward: weak references tell.
            kept = len(self._seen) == len(grads) and all(r() is g for r, g in zip(self._seen, grads, strict=True))
            self._views = (grads, views) if kept and all(g.is_contiguous() for g in grads) else ([], [])
            self._seen = [weakref.ref(g) for g in grads]
        return gradient_sample(grads, views=views)

    def before_reduce(self, window: Any) -> None:
        """Hand the rows no window carried yet to ``window``'s collective (:meth:`WindowTotals.carry`)."""
        for i, (step, local, rows) in enumerate(self._pending):
            if rows is None:
                self._pending[i] = (step, local, window.carry(local))

    def after_reduction(self, step: int, window: Any) -> None:
        """Take this step's numbers (this rank's row); the next window's collective carries them to the other
        ranks, and :meth:`judge` compares them."""
        if self.world == 1:
            return
        sampled = self._sample() if self.gradients else torch.zeros(2, dtype=torch.float64, device=window.device)
        self._pending.append((step, window.row(sampled, rng_hash(self.device)), None))  # FIELDS

    def judge(self, through: int) -> None:
        """Judge the comparisons of the steps up to ``through`` still pending: from the window totals that carried
        them, else (before a checkpoint, a tripwire check, at the end) gathered now; raises on a gradient mismatch.
        Collective when something is gathered: every rank's loop calls it at the same step."""
        while self._pending and self._pending[0][0] <= through:
            step, local, carried = self._pending.pop(0)
            rows = carried() if carried is not None else None
            self._judge(step, rows if rows is not None else self._gather(local))

    def _judge(self, step: int, rows: list[list[float]]) -> None:
        if self.gradients and not all_same([row[:2] for row in rows]):
            self._fail(step, groups([row[:2] for row in rows]))
        data = [row[2:4] for row in rows]
        if data[0][1] > 0 and all(math.isfinite(x) for x in data[0]) and all_same(data):
            self._warn(step, "same_samples",
                       f"every rank trained on identical data at optimizer step {step} (the same loss sum "
                       f"{data[0][0]:.9g} over the same {data[0][1]:.0f} loss items on all {self.world} ranks): the "
                       "ranks are probably reading the same samples (a sampler or dataset that ignores the rank), "
                       "so the effective batch is 1/world of what it should be")
        if all_same([row[4:5] for row in rows]):
            self._warn(step, "same_rng",
                       f"every rank's random-number generator was last seeded with the same seed (optimizer step "
                       f"{step}): the ranks draw the same random numbers (the same dropout masks on different "
                       "samples). Something re-seeded every rank alike; seed each rank differently (distaccum's "
                       "Trainer does: trainer.seed + a rank offset)")

    def _warn(self, step: int, check: str, message: str) -> None:
        if check in self.warned:
            return
        self.warned.add(check)
        if self.rank == 0:
            print(f"distaccum: warning: {message}", file=sys.stderr, flush=True)
            with open(self.run_dir / WARNINGS, "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "check": check, "message": message}) + "\n")

    def _fail(self, step: int, by_gradient: list[list[int]]) -> None:
        agree, odd = by_gradient[0], sorted(r for g in by_gradient[1:] for r in g)
        named = self._params()
        # Read after the step (the verdict waits for it): the gradients are gone, the parameters they moved
        # differently are not. The first parameter whose update differs is the first whose gradient did.
        rows = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                            for _, p in named]) if named else torch.zeros(0, 2, dtype=torch.float64)
        per_rank = [torch.tensor(r, dtype=torch.float64).view(-1, 2) for r in self._gather(rows.flatten())]
        base = per_rank[agree[0]]
        differ = [i for i in range(len(named))
                  if any(not all(same(a, b) for a, b in zip(per_rank[r][i].tolist(), base[i].tolist(), strict=True))
                         for r in odd)]
        parameter = named[differ[0]][0] if differ else "(a sampled element only)"
        message = (f"ranks disagree on the reduced gradient at optimizer step {step}: rank(s) {', '.join(map(str, odd))} "
                   f"differ from rank(s) {', '.join(map(str, agree))} (reduction fingerprint); first differing "
                   f"parameter {parameter!r} ({len(differ)} of {len(named)} gradients differ). The gradients were "
                   "not reduced identically on every rank (a rank skipped or missed the reduction, no_sync on the "
                   "wrong micro-batch, a comm hook that keeps local values, DDP static_graph with no_sync). The "
                   "run stopped when the comparison was read: one step later, or at once before a checkpoint or at the "
                   "end of the run.")
        if self.rank == 0:
            report = {"step": step, "parameter": parameter, "rank": odd[0], "ranks": odd,
                      "differing_parameters": len(differ), "check": "fingerprint", "message": message}
            (self.run_dir / DIVERGENCE).write_text(json.dumps(report, indent=2) + "\n")
        raise RankDivergenceError(message, step=step, parameter=parameter, rank=odd[0])
