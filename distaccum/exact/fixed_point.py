"""The int64 fixed-point accumulator: a window's pieces' gradients summed exactly, whatever the order.

A step's window is cut into P = G / micro_batch pieces in a fixed order (piece m W + r is rank r's micro-batch m,
:mod:`distaccum.data.global_batch`); with a fixed micro-batch each piece holds the same samples for every K and world
size W, so its gradient g_p has the same bits. Only the order of the sum over p differs between splits, and a
floating-point sum depends on it. Here each tensor t has a power-of-two scale 2^e_t, the same on every rank, and each
piece adds q_p = round(g_p 2^e_t) into an int64 accumulator; the ranks' accumulators are summed by an int64
all-reduce, and the sum is converted once: G_t = (sum_p q_p) 2^-e_t. Integer addition is associative, so G_t is the
same number for every K, W, collective algorithm and rank order, and only the rounding of each g_p 2^e_t (to a
multiple of 2^-e_t) and the one conversion (to the parameters' dtype) round at all.

The headroom, derived. Let m_t be the largest |g_p| of tensor t over the step's pieces (a maximum: exact in floating
point and independent of the order, so the ranks agree on it bit for bit after a MAX all-reduce).

* A step is accepted only if m_t 2^e_t < 2^LIMIT_BITS (LIMIT_BITS = 46) for every t. Then each |q_p| <= 2^46, and the
  sum of P <= 2^PIECE_BITS = 2^16 pieces is at most 2^62 < 2^63 - 1: no int64 sum, partial or total, in any order,
  can overflow. Runs with more than 2^16 pieces per step are refused.
* The scale of step s + 1 comes from step s's maximum: with m = f 2^x (1/2 <= f < 1), e = TARGET_BITS - x
  (TARGET_BITS = 40) puts m 2^e in [2^39, 2^40): the largest gradient keeps 39 to 40 significant bits (fp32
  accumulation keeps 24), and the next step's largest gradient may grow by HEADROOM_BITS = 6 bits (at least 64x)
  before it trips the check above.
* A step that trips it is not returned wrong: nothing is applied, the scale is set from the step's own maximum and the
  same window runs again (:attr:`~distaccum.engines.base.StepResult.redo`). The pieces are deterministic (the
  same samples, the dropout seeded by the piece), so the second pass has the same maximum and fits. The first step
  has no previous maximum: its first pass only measures (one extra pass per run, and per resume without a scale).
* Exponents are clamped to [-EXPONENT_LIMIT, EXPONENT_LIMIT] (120) so that 2^e and 2^-e stay normal fp32 numbers: a
  tensor whose gradients stay below 2^-80 keeps fewer bits, never a wrong sum.

A gradient smaller than 2^-(e_t + 1) rounds to zero in its piece; that rounding is the same for every split. A
non-finite gradient skips the step on every rank (it cannot be quantized; the non-finite policy counts it).

Cost per piece on the rank that computed it (counted in ``benchmarks/host_ops.py``): a handful of operators over one
flat buffer whatever the number of tensors (the tensors' maxima, the scaled copy, its rounding, the int64 add, the
zeroing), no host sync. Per step: one MAX all-reduce of one number per tensor and one host read of it, one int64 SUM
all-reduce of every gradient (8 bytes per element: twice fp32's; a sharded engine reduce-scatters it instead), the
conversion. Memory: the local gradients live in one flat buffer of their own (4 bytes per fp32 parameter, whole on
every rank also under FSDP2; DDP's buckets stay allocated, unused), plus a per-element scale (the gradients' dtype),
the scaled copy, an int64 copy and the int64 accumulator: 4 + 4 + 8 + 8 = 24 bytes per fp32 parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LIMIT_BITS = 46
"""A piece's quantized gradient must stay below 2^LIMIT_BITS in magnitude (the overflow check)."""
PIECE_BITS = 16
"""At most 2^PIECE_BITS pieces per step: with the limit above, 2^(46 + 16) = 2^62 < 2^63."""
HEADROOM_BITS = 6
"""Growth of the largest gradient from one step to the next that needs no redo (at least 2^6 = 64x)."""
TARGET_BITS = LIMIT_BITS - HEADROOM_BITS
"""Where the previous step's largest gradient lands: [2^39, 2^40)."""
EXPONENT_LIMIT = 120
"""|e| bound: 2^e and 2^-e stay normal fp32 numbers."""
MAX_PIECES = 2**PIECE_BITS


class Outcome(Enum):
    """What :meth:`FixedPoint.reduce` found."""

    SUMMED = "summed"
    """The gradients hold the exact sum, converted."""
    REDO = "redo"
    """A piece did not fit (or the first step measured): nothing summed; run the window again."""
    NONFINITE = "nonfinite"
    """Some gradient was not finite: skip the step (its tensors' gradients hold NaN)."""


def exponent_for(maximum: float, previous: int | None) -> int:
    """The scale exponent that puts ``maximum`` in [2^39, 2^40) (clamped); ``previous`` (or TARGET_BITS) for 0."""
    if maximum == 0.0:
        return previous if previous is not None else TARGET_BITS
    _, x = math.frexp(maximum)  # maximum = f 2^x, 1/2 <= f < 1
    return max(-EXPONENT_LIMIT, min(EXPONENT_LIMIT, TARGET_BITS - x))


def fits(maximum: float, exponent: int) -> bool:
    """Whether every piece of a tensor whose largest gradient is ``maximum`` fits at ``exponent`` (exact: a power
    of two times a float, compared with a power of two)."""
    return math.ldexp(maximum, exponent) < 2.0**LIMIT_BITS


class FixedPoint:
    """One rank's fixed-point accumulator over ``params``: their gradients are views into one flat buffer, each piece
    is folded into the int64 accumulator after its backward (:meth:`add_piece`), and :meth:`reduce` sums the ranks'
    accumulators and writes the converted sum back into the gradients."""

    def __init__(self, params: list[nn.Parameter], device: torch.device, group: Any = None) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
            raise ValueError(
                f"accum.exact needs every trained parameter in one floating dtype, got {sorted(map(str, dtypes))}"
            )
        dtype = next(iter(dtypes))
        self.params, self.group = params, group
        self.sizes = [p.numel() for p in params]
        total = sum(self.sizes)
        self.flat = torch.zeros(total, dtype=dtype, device=device)
        """The gradients: ``p.grad`` of every parameter is a view into it (a backward adds into it in place)."""
        self.segments = list(self.flat.split(self.sizes))
        self.scaled = torch.empty_like(self.flat)
        self.ints = torch.empty(total, dtype=torch.int64, device=device)
        self.acc = torch.zeros(total, dtype=torch.int64, device=device)
        self.peak = torch.zeros(len(params), dtype=dtype, device=device)
        """This rank's largest |gradient| per tensor over the step's pieces so far."""
        self.scale = torch.empty_like(self.flat)
        """2^e of each element's tensor."""
        self.exponents: list[int] | None = None
        """Each tensor's e (None: no step yet; the first pass measures)."""
        self.redos = 0
        """Passes that were run again (the first step's measuring pass included)."""
        self._sizes = torch.tensor(self.sizes)
        self._offsets = [0]
        for n in self.sizes[:-1]:
            self._offsets.append(self._offsets[-1] + n)

    @property
    def bytes_per_step(self) -> int:
        """Bytes this rank's int64 SUM all-reduce sends into the collective per step (its accumulator)."""
        return self.acc.numel() * self.acc.element_size()

    def attach(self) -> None:
        """Make every parameter's gradient the view of its segment (again where a step or a user dropped it)."""
        base = self.flat.data_ptr()
        size = self.flat.element_size()
        for p, offset in zip(self.params, self._offsets, strict=True):
            if p.grad is None or p.grad.data_ptr() != base + offset * size:
                p.grad = self.flat[offset : offset + p.numel()].view_as(p)

    def add_piece(self) -> None:
        """Fold the piece the gradients hold into the accumulator and zero them. No host sync."""
        maxima = torch._foreach_norm(self.segments, ord=math.inf)
        torch.maximum(self.peak, torch.stack(maxima), out=self.peak)
        if self.exponents is not None:  # the first step's first pass only measures
            torch.mul(self.flat, self.scale, out=self.scaled)  # exact: times a power of two
            self.scaled.round_()
            self.ints.copy_(self.scaled)  # exact: integers below 2^46 (checked at the step)
            self.acc.add_(self.ints)
        self.flat.zero_()

    def reduce(
        self, ledger: Any = None, shards: list[torch.Tensor] | None = None, across: Any = None
    ) -> Outcome:
        """Sum the ranks' accumulators into the gradients (collective), unless a piece did not fit the scale or was
        not finite. Sets the next step's scale from this step's maximum. ``shards`` (a sharded engine: each
        parameter's local shard of its gradient, dim 0 cut in ``torch.chunk`` pieces over the group's ranks): an int64
        reduce-scatter writes each rank's shards instead of an all-reduce of the whole gradients. ``across`` (replica
        groups, an :class:`~distaccum.exact.engine.AcrossGroups`): the maximum and the int64 sum then cross the groups
        too (each group's rank r holds the same shards), after the group's own and before the conversion."""
        dist.all_reduce(self.peak, op=dist.ReduceOp.MAX, group=self.group)  # exact, in any order
        if across is not None:
            across.all_reduce(self.peak, "max")
        maxima = self.peak.tolist()  # the one host read per step
        self.peak.zero_()
        if not all(map(math.isfinite, maxima)):
            self.acc.zero_()
            for segment, m in zip(self.segments, maxima, strict=True):
                if not math.isfinite(m):
                    segment.fill_(math.nan)
            return Outcome.NONFINITE
        current = self.exponents
        if current is None or not all(fits(m, e) for m, e in zip(maxima, current, strict=True)):
            self.acc.zero_()
            self.redos += 1
            previous: list[int | None] = list(current) if current is not None else [None] * len(maxima)
            self._set_exponents([exponent_for(m, e) for m, e in zip(maxima, previous, strict=True)])
            return Outcome.REDO
        if shards is None:
            token = ledger.launched(self.acc, blocking=True) if ledger is not None else None
            dist.all_reduce(self.acc, group=self.group)  # int64 SUM: exact and associative
            if ledger is not None:
                ledger.completed(token)
            if across is not None:
                across.all_reduce(self.acc, "sum")
            self.flat.copy_(self.acc)  # the one rounding of the sum (to the gradients' dtype)
            self.flat.div_(self.scale)  # exact: a power of two
        else:
            self._scatter(shards, current, ledger, across)
        self.acc.zero_()
        self._set_exponents([exponent_for(m, e) for m, e in zip(maxima, current, strict=True)])
        return Outcome.SUMMED

    def _scatter(self, shards: list[torch.Tensor], exponents: list[int], ledger: Any, across: Any) -> None:
        """The int64 reduce-scatter into the local gradient shards (rows of dim 0 chunked as ``torch.chunk`` does,
        padded to equal chunks on the wire), each converted once."""
        world = dist.get_world_size(self.group)
        rows = [p.shape[0] if p.dim() else 1 for p in self.params]
        chunks = [
            -(-r // world) * (n // max(r, 1)) for r, n in zip(rows, self.sizes, strict=True)
        ]  # per rank
        padded = [
            torch.nn.functional.pad(segment, (0, chunk * world - segment.numel())).view(world, chunk)
            for segment, chunk in zip(self.acc.split(self.sizes), chunks, strict=True)
        ]
        wire = torch.cat(padded, dim=1).reshape(-1)  # [rank][parameter]: rank r's chunks side by side
        mine = torch.empty(sum(chunks), dtype=torch.int64, device=self.acc.device)
        token = ledger.launched(wire, blocking=True) if ledger is not None else None
        dist.reduce_scatter_tensor(mine, wire, group=self.group)  # int64 SUM: exact and associative
        if ledger is not None:
            ledger.completed(token)
        if across is not None:
            across.all_reduce(mine, "sum")
        for shard, part, e in zip(shards, mine.split(chunks), exponents, strict=True):
            if shard.numel():
                shard.copy_(part[: shard.numel()].view_as(shard))  # the one rounding of the sum
                shard.div_(math.ldexp(1.0, e))  # exact: a power of two

    def _set_exponents(self, exponents: list[int]) -> None:
        if exponents == self.exponents:
            return
        self.exponents = exponents
        powers = torch.tensor([math.ldexp(1.0, e) for e in exponents], dtype=self.scale.dtype)
        per_element = torch.repeat_interleave(powers, self._sizes, output_size=self.scale.numel())
        self.scale.copy_(per_element)  # a few operators per step, whatever the number of tensors

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the next step's exponents (a resumed run must scale as the uninterrupted one)."""
        return {"exponents": self.exponents, "redos": self.redos}

    def load(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state` (no exponents: the next step measures first)."""
        if state.get("exponents") is None:
            self.exponents = None
        else:
            self._set_exponents([int(e) for e in state["exponents"]])
        self.redos = int(state.get("redos", 0))


def params_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of named tensors, by name: each one's name, dtype, shape and bytes (the same for two runs whose
    parameters have the same bits, whatever order they are listed in)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        t = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
