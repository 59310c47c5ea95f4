"""The reduction checksum of sharded engines: one weighted sum of each rank's local gradient before the boundary
reduction, one of the reduced shard it holds after it, so the reduction can be checked where no rank holds the whole
reduced gradient (FSDP2, HSDP, DeepSpeed ZeRO 1-3; ZeRO-0, which all-reduces, checks each rank as a replica).

The invariant. Rank r's local gradient g_r is what autograd handed its parameters over the window's K micro-batches,
before any reduction; the engine's reduction makes G = s * sum_r g_r (s = 1 for FSDP2's SUM, 1/W for DeepSpeed's
mean) and leaves each element of G on exactly one rank of each replica. Take fixed weights w on a fixed sample of
element positions, the same on every rank (:func:`sample_positions`). Linearity gives

    sum_r w . g_r  =  w . G / s  =  sum_{r in replica} w|r . G|r / s        for every replica,

where w|r is w restricted to the positions rank r holds. So each rank sends three numbers: a = w . g_r (its local
side, taken from the gradient autograd delivers, so it exists whether or not a reduction runs), m = sum |w| |g_rk|
over its micro-batches (the scale of the rounding) and b = w|r . G|r / s; the ranks check, for every replica,
``|sum_replica b - sum_all a| <= tolerance * sum_all m``. A skipped reduction (b holds a local value, or nothing), a
doubled one (2 a) or a mis-scaled one leaves the equality by far more than rounding.

The tolerance is the first-order rounding bound of what runs between the two sides: each element's K micro-batch
gradients are added in the accumulation dtype (K - 1 roundings of at most u times the running sum of magnitudes),
cast to the reduce dtype (1), summed over the W ranks by the collective in whatever order (W - 1), and, under
DeepSpeed, divided by W (1); m bounds every partial sum, so the difference is at most (K + W + 1) u m; the factor
used is (K + W + 2) u, u the unit roundoff of the coarsest dtype the gradient is held or reduced in (2^-24 fp32,
2^-8 bf16, 2^-11 fp16). Both sides are computed exactly in float64 from the values the engine itself holds (a bf16
gradient is read as it is), so bf16 compute with an fp32 reduction has fp32's tolerance.

Cost: the local side is read from every micro-batch's incoming gradient, one ``take`` per parameter into a
row of a (K, n) buffer (n about :data:`~distaccum.engines.base.SAMPLE` elements); the rest is a fixed handful of
operators per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from distaccum.engines.base import SAMPLE

SEED = 0x5EED5
"""The sample's positions and weights come from a generator seeded with this: the same on every rank."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a float dtype of p significand bits (fp32: 2^-24, bf16: 2^-8, fp16: 2^-11)."""
    return float(torch.finfo(dtype).eps) / 2.0


def sample_positions(numels: list[int], sample: int = SAMPLE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """For each tensor of ``numels`` elements: (positions in its flattened form, weights in [1, 2)), about
    ``sample`` positions over all of them in proportion to their sizes, every tensor's first element included.
    Deterministic (a fixed seed, on the CPU): every rank draws the same."""
    generator = torch.Generator().manual_seed(SEED)
    total = max(sum(numels), 1)
    out = []
    for numel in numels:
        count = min(numel, max(1, round(sample * numel / total)))
        rest = torch.randint(0, max(numel, 1), (max(count - 1, 0),), generator=generator)
        positions = torch.cat([torch.zeros(1, dtype=torch.int64), rest]) if numel else rest
        out.append((positions, 1.0 + torch.rand(positions.numel(), generator=generator, dtype=torch.float64)))
    return out


def tolerance(accum_steps: int, world: int, dtypes: list[torch.dtype]) -> float:
    """(K + W + 2) u, u of the coarsest of ``dtypes`` (see the module docstring)."""
    return (accum_steps + world + 2) * max(unit_roundoff(d) for d in dtypes)


class ReductionChecksum:
    """This rank's two sides of the invariant for a fixed list of parameters.

    ``numels`` are the parameters' whole sizes; ``owned[j] = (lo, hi)``: the flat positions of parameter j this rank
    holds after the reduction (its shard holds position i at i - lo). ``dtype`` and ``reduced_dtype``: the local
    gradients' and the reduced shards' (another is copied, one more operator). :meth:`watch` hooks the tensors
    autograd accumulates into; the engine sets :attr:`micro` to the micro-batch of the window before each backward and calls
    :meth:`take` at the step with the reduced shards."""

    def __init__(
        self,
        numels: list[int],
        owned: list[tuple[int, int]],
        accum_steps: int,
        device: torch.device,
        dtype: torch.dtype,
        reduced_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.replicas: list[list[int]] = []
        """The ranks of each replica (set by the engine): each must hold the reduced gradient once."""
        self.tolerance = 0.0
        """The rounding bound, as a fraction of the summed magnitudes m (set by the engine: :func:`tolerance`)."""
        drawn = sample_positions(numels)
        starts = [0]
        for positions, _ in drawn:
            starts.append(starts[-1] + positions.numel())
        self.slots = [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
        self.positions = [p.to(device) for p, _ in drawn]
        self.weights = torch.cat([w for _, w in drawn]).to(device)
        self.rows = torch.zeros(accum_steps, starts[-1], dtype=dtype, device=device)
        """Row k: the sample of micro-batch k's incoming gradient, in the gradients' dtype (exact)."""
        self._row_views = [[row[slot] for slot in self.slots] for row in self.rows]
        """Each micro-batch's row cut per parameter, made once: the hooks issue one operator each."""
        self._written = [-1] * len(numels)
        local, local_weights, local_slots = [], [], []
        at = 0
        for (positions, weights), (lo, hi) in zip(drawn, owned, strict=True):
            mine = (positions >= lo) & (positions < hi)
            local.append((positions[mine] - lo).to(device))
            local_weights.append(weights[mine])
            local_slots.append(slice(at, at + int(mine.sum())))
            at += int(mine.sum())
        self.local, self.local_slots = local, local_slots
        self.local_weights = torch.cat(local_weights).to(device) if local_weights else torch.zeros(0)
        self.reduced = torch.zeros(at, dtype=reduced_dtype, device=device)
        """The reduced shards' sample, in their dtype (exact; widened to float64 once a step)."""
        self._reduced_views = [self.reduced[slot] for slot in local_slots]
        self.micro = 0
        """The micro-batch (0-based, within the window) whose backward runs: the row its gradients go to."""

    @property
    def nbytes(self) -> int:
        """The buffers' memory (positions, weights, rows, the reduced sample)."""
        tensors = [*self.positions, *self.local, self.weights, self.local_weights, self.rows, self.reduced]
        return sum(t.numel() * t.element_size() for t in tensors)

    def watch(self, leaves: Sequence[torch.Tensor]) -> list[Any]:
        """Hook each parameter's autograd leaf (``leaves[j]`` for parameter j): every gradient autograd delivers to
        it is sampled into the current micro-batch's row, before anything accumulates or reduces it. A frozen parameter
        gets no gradient on either side and no hook."""
        return [leaf.register_hook(self._hook(j)) for j, leaf in enumerate(leaves) if leaf.requires_grad]

    def _hook(self, j: int) -> Any:
        positions = self.positions[j]

        def sample(grad: torch.Tensor) -> None:
            row = self._row_views[self.micro][j]
            if self._written[j] == self.micro:  # a second delivery in one backward (reentrant checkpointing)
                row.add_(torch.take(grad, positions))
            elif grad.dtype == row.dtype:
                torch.take(grad, positions, out=row)  # row-major positions, whatever the gradient's strides
            else:
                row.copy_(torch.take(grad, positions))
            self._written[j] = self.micro

        return sample

    def take(self, shards: list[torch.Tensor | None], divisor: float = 1.0) -> torch.Tensor:
        """[a, m, b] in float64 on the device: a and m of the window's local gradients (its rows), b of the reduced
        ``shards`` (parameter j's owned positions, flattened; None: no reduced gradient), times ``divisor`` (the
        engine's reduction divided by it). Starts the next window (rows cleared)."""
        for j, shard in enumerate(shards):
            view = self._reduced_views[j]
            if not view.numel():
                continue
            if shard is None:
                view.zero_()
            elif shard.dtype == view.dtype:
                torch.take(shard, self.local[j], out=view)
            else:
                view.copy_(torch.take(shard, self.local[j]))
        rows = self.rows.to(torch.float64)
        local = torch.stack([rows.sum(0), rows.abs().sum(0)])
        reduced = self.reduced.to(torch.float64) @ self.local_weights
        sums = torch.cat([torch.mv(local, self.weights), reduced.mul(divisor).view(1)])
        self.rows.zero_()  # micro-batches a parameter takes no part in deliver nothing
        self._written = [-1] * len(self._written)
        return sums


def agree(rows: list[list[float]], groups: list[list[int]], tol: float) -> tuple[bool, list[float]]:
    """Whether every group's (replica's) reduced sums match the local sums: ``rows[r] = [a, m, b]``. Returns the
    verdict and each group's ratio b / a (for the message). A non-finite gradient is the non-finite policy's:
    not judged here."""
    a = math.fsum(row[0] for row in rows)
    m = math.fsum(row[1] for row in rows)
    if not (math.isfinite(a) and math.isfinite(m)):
        return True, []
    ratios, ok = [], True
    for group in groups:
        b = math.fsum(rows[r][2] for r in group)
        ratios.append(b / a if a else math.inf if b else 1.0)
        if not (math.isfinite(b) and abs(b - a) <= tol * m):
            ok = False
    return ok, ratios
