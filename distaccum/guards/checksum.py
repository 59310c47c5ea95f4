"""The reduction checksum of sharded engines: each rank's local gradient, sampled just as the engine reduces it, is
summed exactly over the ranks and compared element by element with the reduced shard that holds it, so the reduction
can be checked where no rank holds the whole reduced gradient (FSDP2, HSDP, DeepSpeed ZeRO 1-3; ZeRO-0, which
all-reduces, checks each rank as a replica).

The invariant. At a fixed sample of element positions (:func:`sample_positions`, the same on every rank), let x_r be
what rank r hands the reduction: its K micro-batch gradients accumulated as the engine accumulates them and cast to
the reduce dtype. The engine's reduction makes G = s * fl(sum_r x_r) (s = 1 for FSDP2's SUM, 1/W for DeepSpeed's
mean) and leaves each element of G on exactly one rank of each replica. Every x_r is a value of a narrow dtype, so
float64 holds it exactly, and one all-reduce of the sample (2n float64 numbers, n about :data:`SAMPLE`) gives
every rank, exactly up to float64's own rounding,

    S_i = sum_r x_ri        and        A_i = sum_r |x_ri|.

The only thing between S_i and the reduced value B_i = G_i / s (read exactly in float64) is the rounding of the
reduction itself. A sum of W terms in a dtype of unit roundoff u, in any order (ring, tree, pairwise), is the exact
sum of its terms times factors (1 + d), |d| <= u, at most W - 1 of them per term, so (first order)
|fl(sum_r x_r) - S| <= (W - 1) u A. DeepSpeed's divide by W adds u A (none when W is a power of two: exact), a cast
of the result into a narrower dtype that holds it adds u A, float64's own sums 2^-53 W A, and values below the
dtype's normal range an absolute quantum per operation (``floor``). Second-order terms are covered by dividing by
1 - n u, n the roundings one element goes through (Higham's gamma_n = n u / (1 - n u)). So for a correct reduction, for every sampled element,

    |B_i - S_i|  <=  c A_i + floor,      c = (W - 1) u + [W not a power of two] u + [narrower result] u + ...

by construction, whatever the data: a correct run is never flagged. The accumulation over the K micro-batches is
not in the compared difference: the engine's own accumulation is reproduced exactly from the sampled micro-batch
gradients (``Rounding.accumulate``: the dtype it runs in, the same additions in the same order, so the same bits;
the hooks read each micro-batch's gradient as autograd delivers it, before anything accumulates or reduces it).
Where an engine reduces every micro-batch and accumulates the reduced pieces (``accumulate=None``: FSDP2
``every_micro`` and ``replica_boundary``, ZeRO-2/3 ``every_micro``), or where its accumulation is not known
(``exact=False``: DeepSpeed's own cadence, its BF16_Optimizer), S and A run over the micro-batches too and c gains
K u' (u' the dtype the pieces accumulate in): the K-term of the old bound, and then the run says so at start.

What a fault does. A doubled reduction makes B_i - S_i = S_i (up to rounding), a halved one -S_i / 2, a skipped
one x_ri - S_i (minus the other ranks' part) or -S_i (no reduced gradient at all). The check flags a step when any
sampled element leaves its bound, so a fault is caught when some sampled element has |S_i| > 2 c A_i / (1 - c)
(the halving, the smallest of the three): an element whose ranks' gradients do not cancel to within 2 c. With
bf16 (u = 2^-8) and W = 64, 2 c is about 1/2; ``benchmarks/checksum_margin.py`` sweeps K x W x dtype on random
gradients and prints the margin (docs/verification.md). What cannot be caught by any check on these numbers: a
doubled reduction of a gradient whose ranks cancel exactly (S_i = 0 at every sampled element). Where the needed
agreement h = 2 c / (1 - c) exceeds 1 / sqrt(W), what W independent zero-mean gradients typically keep of their
magnitudes once summed, gradients uncorrelated across the ranks are not checked, and the run says so at start
(:meth:`Rounding.describe`): bf16 from W = 23 on (at W = 64 h = 0.99 against 0.125), never fp32,
fp16 not up to W = 64 (h 0.066 against 0.125). The sample's extreme elements still catch uncorrelated faults up to
about W = 48 in bf16 (the sweep); the statement at start promises only the typical element.

Each rank sends three numbers to the fingerprint (:func:`agree`): over the sampled elements it holds after the
reduction, a = sum |S_i|, b = sum sign(S_i) B_i (so b / a is 2 for a doubled reduction, 1/2 for a halved one) and
v = max |B_i - S_i| / (c A_i + floor), the worst element's share of its bound (<= 1 for a correct reduction).

Cost: per micro-batch, one ``take`` per parameter into a row of a (K, n) buffer (the gradient as delivered, exact);
per step, the accumulation's K - 1 additions on n elements, one all-reduce of 2n float64 numbers (over the group the
engine reduces over) and a fixed handful of operators (``python -m benchmarks.checksum_margin --ops`` counts them).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

SAMPLE = 4096
"""The sampled elements of a step's reduced gradient, about: the checksum's sample (:func:`sample_positions`) and the
replicated engines' (:class:`~distaccum.engines.base.GradSample`)."""
SEED = 0x5EED5
"""The sample's positions and weights come from a generator seeded with this: the same on every rank."""


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a float dtype of p significand bits (fp32: 2^-24, bf16: 2^-8, fp16: 2^-11)."""
    return float(torch.finfo(dtype).eps) / 2.0


def quantum(dtype: torch.dtype) -> float:
    """The absolute rounding error of one operation whose result falls below ``dtype``'s normal range: half its
    smallest subnormal spacing (``tiny * eps / 2``)."""
    info = torch.finfo(dtype)
    return float(info.tiny) * float(info.eps) / 2.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rounding:
    """What an engine's reduction does between the sampled micro-batch gradients and the reduced shard it holds."""

    world: int
    """W: the ranks whose gradients one reduction sums."""
    accum_steps: int
    """K: micro-batches per window."""
    reduce: torch.dtype
    """The dtype the reduction's additions run in."""
    held: torch.dtype
    """The dtype of the reduced shard read at the step (a narrower one than ``reduce`` rounds once more)."""
    accumulate: torch.dtype | None
    """The dtype the window's K local gradients accumulate in before the one reduction (``acc += g``, the first
    cast in, as autograd and FSDP2 do); None: every micro-batch is reduced and the reduced pieces accumulate, in
    ``held``."""
    exact: bool = True
    """False: the engine's accumulation is not known exactly; its K roundings enter the bound (in ``accumulate``,
    or ``reduce`` when None)."""
    divides: bool = False
    """The reduction divides by W (DeepSpeed's mean): one more rounding unless W is a power of two."""

    @property
    def k_term(self) -> bool:
        """Whether the K micro-batches' rounding is part of the bound (see the module docstring)."""
        return self.accumulate is None or not self.exact

    def coefficient(self) -> float:
        """c of the module docstring: |B_i - S_i| <= c A_i + floor for a correct reduction."""
        w, k = self.world, self.accum_steps
        u = unit_roundoff(self.reduce)
        c = (w - 1) * u
        if self.divides and w & (w - 1):
            c += u
        if unit_roundoff(self.held) > u:
            c += unit_roundoff(self.held)
        if self.k_term:
            c += k * max(unit_roundoff(self.accumulate or self.held), unit_roundoff(self.held), u)
        c += w * 2.0**-53
        operations = w + 2 + (k if self.k_term else 0)  # the roundings one element goes through, at most
        coarsest = max(unit_roundoff(d) for d in (self.reduce, self.held, self.accumulate or self.held))
        return c / (
            1.0 - operations * coarsest
        )  # Higham's gamma_n = n u / (1 - n u): the first-order bound made rigorous

    def floor(self) -> float:
        """The absolute part of the bound: one subnormal quantum per operation (K + W + 3 of them), times W."""
        dtypes = (self.reduce, self.held, self.accumulate or self.held)
        return (self.accum_steps + self.world + 3) * self.world * max(quantum(d) for d in dtypes)

    def cancellation(self) -> float:
        """h = 2c / (1 - c): a halved reduction (the smallest fault) is caught at a sampled element only where its
        ranks' gradients keep |S_i| > h A_i once summed (the module docstring)."""
        c = self.coefficient()
        return 2.0 * c / (1.0 - c) if c < 1.0 else math.inf

    @property
    def checks_uncorrelated(self) -> bool:
        """Whether h < 1 / sqrt(W): W ranks' gradients that are independent and zero-mean keep |S| / A about
        1 / sqrt(W) (for Gaussian terms E|S| = sqrt(2W / pi) sigma, E A = W sqrt(2 / pi) sigma). Where h is above it
        a wrong reduction of such gradients is not checked (bf16 from W = 23 on: the module docstring). With the
        K-term the W K reduced pieces count (1 / sqrt(W K))."""
        return self.cancellation() < self.terms**-0.5

    @property
    def terms(self) -> int:
        """The pieces S and A sum over: W, or W K with the K-term."""
        return self.world * (self.accum_steps if self.k_term else 1)

    @property
    def announced(self) -> bool:
        """Whether the run says at start what the check cannot see (:meth:`describe`)."""
        return self.k_term or not self.checks_uncorrelated

    def describe(self) -> str:
        """One line for the console: what the bound covers, and what it does not check."""
        how = f"{self.reduce}".replace("torch.", "")
        blind = (
            ""
            if self.checks_uncorrelated
            else (
                f"; NOT CHECKED for gradients uncorrelated across its {self.terms} summed pieces: a wrong reduction "
                f"is caught only at elements whose pieces agree to |sum| > {self.cancellation():.3g} x sum|x|, "
                f"uncorrelated ones reach about {self.terms**-0.5:.3g} (a reduction in fp32 checks them)"
            )
        )
        if not self.k_term:
            return (
                f"reduction checksum: exact local side, bound {self.coefficient():.3g} x sum|x| "
                f"(W={self.world}, {how}){blind}"
            )
        why = (
            "each micro-batch is reduced on its own"
            if self.accumulate is None
            else "the engine's accumulation is not reproduced"
        )
        return (
            f"reduction checksum: {why}, so the K={self.accum_steps} micro-batches' rounding is in the bound "
            f"({self.coefficient():.3g} x sum|g|, {how}): a wrong reduction is caught only where the gradient "
            f"agrees over the micro-batches{blind}"
        )


def sample_positions(numels: list[int], sample: int = SAMPLE) -> list[torch.Tensor]:
    """For each tensor of ``numels`` elements, positions in its flattened form: about ``sample`` over all of them in
    proportion to their sizes, every tensor's first element included. Deterministic (a fixed seed, on the CPU):
    every rank draws the same."""
    generator = torch.Generator().manual_seed(SEED)
    total = max(sum(numels), 1)
    out = []
    for numel in numels:
        count = min(numel, max(1, round(sample * numel / total)))
        rest = torch.randint(0, max(numel, 1), (max(count - 1, 0),), generator=generator)
        out.append(torch.cat([torch.zeros(1, dtype=torch.int64), rest]) if numel else rest)
    return out


def local_parts(rows: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """[x, |x|] (2, n) in float64: this rank's sampled contribution to the reduction from its micro-batch ``rows``
    (K, n), each in the dtype autograd delivered it. Exact: the engine's accumulation reproduced in its dtype, then
    cast to the reduce dtype; or, with a K-term, every micro-batch's piece (its own reduction's input) summed."""
    if rounding.exact and rounding.accumulate is not None:
        acc = rows[0].to(rounding.accumulate, copy=True)
        for row in rows[1:]:
            acc += row  # the same addition, in the same dtype and order, as the engine's: the same bits
        x = acc.to(rounding.reduce).to(torch.float64)
        return torch.stack([x, x.abs()])
    pieces = (rows.to(rounding.reduce) if rounding.exact else rows).to(torch.float64)
    return torch.stack([pieces.sum(0), pieces.abs().sum(0)])


def verdict(exact: torch.Tensor, reduced: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """[a, v, b] (float64) of the sampled elements a rank holds: ``exact`` (2, m) their S and A over the ranks,
    ``reduced`` (m,) their reduced values B (the engine's scaling undone). a = sum |S|, b = sum sign(S) B, v = the
    worst element's |B - S| over its bound (<= 1 for a correct reduction). A non-finite S or A: a = NaN (the
    non-finite policy's, not judged)."""
    s, a = exact[0], exact[1]
    bound = a * rounding.coefficient() + rounding.floor()
    diff = (reduced - s).abs()
    # An element every rank left exactly 0 and reduced to exactly 0 has a bound of 0 in fp64 (its floor underflows):
    # share 0, not 0/0. Reduced to anything else it has an infinite share; a NaN reduced value a NaN one: both fail.
    share = torch.where(diff == 0, torch.zeros_like(diff), diff / bound)
    worst = share.amax() if s.numel() else s.new_zeros(())
    finite = torch.isfinite(exact).all()
    total = torch.where(finite, s.abs().sum(), s.new_tensor(math.nan))
    return torch.stack([total, worst, (torch.sign(s) * reduced).sum()])


class ReductionChecksum:
    """This rank's side of the invariant for a fixed list of parameters.

    ``numels`` are the parameters' whole sizes; ``owned[j] = (lo, hi)``: the flat positions of parameter j this rank
    holds after the reduction (its shard holds position i at i - lo). ``dtype`` and ``reduced_dtype``: the local
    gradients' and the reduced shards' (another is copied, one more operator). :meth:`watch` hooks the tensors
    autograd accumulates into; the engine sets :attr:`rounding`, :attr:`replicas` and :attr:`group`, sets
    :attr:`micro` to the micro-batch of the window before each backward and calls :meth:`take` at the step with the
    reduced shards (collective over :attr:`group`)."""

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
        self.rounding: Rounding | None = None
        """What the engine's reduction rounds (set by the engine): the bound of :func:`verdict`."""
        self.group: Any = None
        """The process group the engine reduces over (None: the world)."""
        drawn = sample_positions(numels)
        starts = [0]
        for positions in drawn:
            starts.append(starts[-1] + positions.numel())
        self.slots = [slice(a, b) for a, b in zip(starts, starts[1:], strict=False)]
        self.positions = [p.to(device) for p in drawn]
        self.rows = torch.zeros(accum_steps, starts[-1], dtype=dtype, device=device)
        """Row k: the sample of micro-batch k's incoming gradient, in the gradients' dtype (exact)."""
        self._row_views = [[row[slot] for slot in self.slots] for row in self.rows]
        """Each micro-batch's row cut per parameter, made once: the hooks issue one operator each."""
        self._written = [-1] * len(numels)
        local, index = [], []
        for positions, (lo, hi), slot in zip(drawn, owned, self.slots, strict=True):
            mine = (positions >= lo) & (positions < hi)
            local.append((positions[mine] - lo).to(device))
            index.append(slot.start + torch.nonzero(mine).flatten())
        self.local = local
        self.owned_index = torch.cat(index).to(device) if index else torch.zeros(0, dtype=torch.int64)
        """Where the sampled elements this rank holds sit in the sample."""
        starts = [0]
        for positions in local:
            starts.append(starts[-1] + positions.numel())
        self.reduced = torch.zeros(starts[-1], dtype=reduced_dtype, device=device)
        """The reduced shards' sample, in their dtype (exact; widened to float64 once a step)."""
        self._reduced_views = [self.reduced[a:b] for a, b in zip(starts, starts[1:], strict=False)]
        self.micro = 0
        """The micro-batch (0-based, within the window) whose backward runs: the row its gradients go to."""

    @property
    def nbytes(self) -> int:
        """The buffers' memory (positions, rows, the reduced sample)."""
        tensors = [*self.positions, *self.local, self.owned_index, self.rows, self.reduced]
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
        """[a, v, b] (:func:`verdict`, float64 on the device) of the reduced ``shards`` (parameter j's owned
        positions, flattened; None: no reduced gradient), times ``divisor`` (the engine's reduction divided by it),
        against the window's local rows summed over the ranks (one all-reduce over :attr:`group`: collective).
        Starts the next window (rows cleared)."""
        assert self.rounding is not None, "the engine sets the rounding before the first step"
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
        parts = local_parts(self.rows, self.rounding)
        dist.all_reduce(parts, group=self.group)  # S and A: exact in float64 up to 2^-53 W A (in the bound)
        sums = verdict(
            parts[:, self.owned_index], self.reduced.to(torch.float64).mul_(divisor), self.rounding
        )
        self.rows.zero_()  # micro-batches a parameter takes no part in deliver nothing
        self._written = [-1] * len(self._written)
        return sums


def agree(rows: list[list[float]], groups: list[list[int]]) -> tuple[bool, list[float], list[float]]:
    """Whether every group's (replica's) reduced elements stay within their rounding bounds: ``rows[r] = [a, v, b]``
    (:func:`verdict`). Returns the verdict, each group's ratio b / a (2: doubled, 0.5: halved, 0: nothing reduced)
    and each group's worst element's share of its bound. A non-finite gradient is the non-finite policy's: not
    judged here."""
    if not all(math.isfinite(row[0]) for row in rows):
        return True, [], []
    ratios, worst = [], []
    for group in groups:
        a = math.fsum(rows[r][0] for r in group)
        b = math.fsum(rows[r][2] for r in group)
        ratios.append(b / a if a else math.inf if b else 1.0)
        worst.append(max(rows[r][1] for r in group))
    ok = all(w <= 1.0 for w in worst)  # a NaN share (NaN reduced, finite local) fails too
    return ok, ratios, worst
