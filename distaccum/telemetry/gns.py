"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training"),
from what one optimizer step already computes: no extra forward/backward; one all-reduce of three numbers.

The simple noise scale is ``B_simple = tr(Sigma) / |G|^2``: G is the true (expected) gradient of the
per-item loss, Sigma the per-item gradient covariance. A mean gradient over B i.i.d. items has
``E|G_B|^2 = |G|^2 + tr(Sigma) / B``, so squared norms at two batch sizes give unbiased estimates of
both (the paper's appendix A.1). Under ``accum.sync=boundary`` DDP sees both sizes in every step:

- rank r's accumulated gradient before the boundary reduction: the mean over its n_r items of the
  window (micro_batch x K samples; n_r loss items), and
- the reduced gradient: the mean over all N = sum_r n_r items.

Normalization. The loop backpropagates ``S_rk * c * d`` (sums, times the power-of-two c and the
engine's divisor d; see :mod:`distaccum.loop`), so the bucket the comm hook receives on rank r holds
``c d L_r`` with ``L_r = sum_k grad S_rk`` (a sum over the rank's items), and the reduction returns
``c L`` with ``L = sum_r L_r`` (d undoes exactly what the reduction divides by). Hence
``|G_r|^2 = |local|^2 / (c d n_r)^2`` and ``|G_N|^2 = |reduced|^2 / (c N)^2``. With unequal item counts the
ranks' estimates average to ``mean_r |G_r|^2 = |G|^2 + tr(Sigma) mean_r(1/n_r)``, so

    tr(Sigma) = (mean_r |G_r|^2 - |G_N|^2) / (mean_r(1/n_r) - 1/N)
    |G|^2     = |G_N|^2 - tr(Sigma) / N

Assumptions: items (samples, or tokens for a token loss) are i.i.d. draws, so B is counted in loss
items; tokens of one sequence are correlated, which makes a token-level B_simple an effective, not
literal, batch size. Per step the two estimates are noisy and |G|^2 can come out negative, so the
logged ``gns`` is raw; ``gns_smoothed`` is the ratio of exponential moving averages
of the two estimates (decay ``log.gns_ema``: an average over roughly 1/(1 - decay) steps), as the
paper recommends (average numerator and denominator separately, then divide). Under fp16 loss scaling both estimates carry the scale squared;
their ratio does not.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from distaccum.window import WindowResult


class GradSquares:
    """Sums of squares of the gradient buckets a comm hook reduces in one step, before and after.

    Per parameter, summed in the model's parameter order when taken: DDP's first step in a process uses its initial
    buckets and rebuilds them in the order gradients became ready, so a per-bucket sum would be rounded differently
    in the first step after a restart than in the same step of an uninterrupted run (the adaptive batch decides on
    these numbers and must decide alike). Tensors on the gradients' device (no host sync in the hook); :meth:`take`
    returns and resets."""

    def __init__(self) -> None:
        self.local: dict[int, torch.Tensor] = {}
        self.reduced: dict[int, torch.Tensor] = {}
        self.order: dict[int, int] = {}
        """``id(parameter)`` -> its position in the model (set by the engine that wraps it)."""

    def _terms(self, data: Any, into: dict[int, torch.Tensor], values: torch.Tensor | None = None) -> None:
        if isinstance(data, torch.Tensor):  # one tensor: keyed after every parameter, in the order added
            pieces = [(len(self.order) + len(into), data)]
        else:  # a DDP GradBucket: each parameter's gradient is a slice of its buffer (of ``values``, reduced)
            buffer = data.buffer()
            flat = (values if values is not None else buffer).reshape(-1)
            pieces = []
            for param, grad in zip(data.parameters(), data.gradients(), strict=True):
                at = grad.storage_offset() - buffer.storage_offset()
                pieces.append((self.order.get(id(param), -1), flat[at : at + grad.numel()]))
        for key, grad in pieces:
            flat = grad.reshape(-1)
            sq = torch.sum(
                flat * flat, dtype=torch.float64
            )  # ATen's sum: its order depends on the length only
            into[key] = sq if key not in into else into[key] + sq

    def add_local(self, data: Any) -> None:
        """A bucket (or a tensor) as this rank produced it (before the reduction touches it)."""
        self._terms(data, self.local)

    def add_reduced(self, data: Any, values: torch.Tensor | None = None) -> None:
        """The same bucket after the reduction (its reduced buffer ``values``, when not reduced in place)."""
        self._terms(data, self.reduced, values)

    def take(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of squares before, after) of the step's buckets, and reset."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        local, reduced = (
            torch.stack([part[k] for k in sorted(part)]).sum().to(device) if part else zero
            for part in (self.local, self.reduced)
        )
        self.local, self.reduced = {}, {}
        return local, reduced


def window_terms(
    squares: GradSquares, local_items: float, c: float, d: float, device: torch.device
) -> list[torch.Tensor]:
    """This rank's three numbers for the noise-scale all-reduce: |G_r|^2, 1/n_r and |L|^2 (identical
    on every rank; :func:`estimate` divides the sum by W). Their sums feed :func:`estimate`."""
    local_sq, reduced_sq = squares.take(device)
    n = max(local_items, 1.0)
    return [
        local_sq / (c * d * n) ** 2,
        torch.tensor(1.0 / n, dtype=torch.float64, device=device),
        reduced_sq / c**2,
    ]


def estimate(sums: list[float], n_total: float, world: int) -> tuple[float, float]:
    """(|G|^2, tr(Sigma)) from the all-reduced :func:`window_terms` of ``world`` ranks and the
    window's global item count ``n_total``."""
    small_sq, inv_small = sums[0] / world, sums[1] / world
    big_sq = (sums[2] / world) / n_total**2  # |L|^2 per rank -> |L / N|^2
    inv_big = 1.0 / n_total
    if inv_small <= inv_big:  # one rank, or every item on one rank: the two sizes coincide
        return math.nan, math.nan
    trace = (small_sq - big_sq) / (inv_small - inv_big)
    return big_sq - trace * inv_big, trace


def record_fields(
    grad_sq: float, trace: float, previous: dict[str, Any] | None, decay: float
) -> dict[str, float]:
    """The step's ``gns*`` record fields. The smoothing state rides in the records (``gns_grad_sq_ema``,
    ``gns_trace_ema``), so a resumed run, whose records are restored, continues the same averages.
    An undefined step (all of a partial window's items on one rank) leaves the averages as they were.
    Bias-correcting the two averages (as Adam does) would divide both by the same factor: their
    ratio needs none."""
    prev = previous or {}
    fields = {"gns_grad_sq": grad_sq, "gns_trace": trace, "gns": trace / grad_sq if grad_sq else math.nan}
    for key, value in (("gns_grad_sq_ema", grad_sq), ("gns_trace_ema", trace)):
        before = prev.get(key, 0.0)
        fields[key] = decay * before + (1.0 - decay) * value if math.isfinite(value) else before
    ema_sq = fields["gns_grad_sq_ema"]
    fields["gns_smoothed"] = fields["gns_trace_ema"] / ema_sq if ema_sq else math.nan
    return fields


class GnsMonitor:
    """``log.gns``: the noise-scale terms of each step (a :class:`~distaccum.loop.StepMonitor`).

    After the boundary backward the engine's comm hook has measured the squared norms; one more
    all-reduce, of three numbers, combines them over the ranks; the record gets the raw estimate and
    its smoothed ratio (the averages ride in the records, so a resumed run continues them)."""

    def __init__(
        self,
        squares: GradSquares,
        decay: float,
        world_size: int,
        rank: int,
        device: torch.device,
        *,
        eager_after: list[dict[str, Any]] | None = None,
    ) -> None:
        self.squares, self.decay, self.world, self.rank, self.device = (
            squares,
            decay,
            world_size,
            rank,
            device,
        )
        self._sums: dict[int, torch.Tensor] = {}
        """Per step until its record is made (a step late under the loop's lagged records)."""
        self.eager = eager_after is not None
        """Compute each step's fields as it ends (:meth:`latest`: the adaptive batch decides on them before the next
        step), at the cost of reading three numbers per step on the host; records continue ``eager_after``'s last."""
        self._fields: dict[int, dict[str, Any]] = {}
        self._last: dict[str, Any] | None = eager_after[-1] if eager_after else None

    def after_step(self, step: int, window: WindowResult, c: float, d: float) -> None:
        terms = window_terms(
            self.squares, window.rank_sums[self.rank][1], c, d, self.device
        )  # this rank's items
        sums = torch.stack(terms)
        dist.all_reduce(sums)
        if not self.eager:
            self._sums[step] = sums
            return
        grad_sq, trace = estimate(sums.tolist(), window.items, self.world)  # the host reads the three numbers
        self._last = self._fields[step] = record_fields(grad_sq, trace, self._last, self.decay)

    def latest(self, step: int) -> dict[str, Any]:
        """Step ``step``'s fields, as soon as it ended (eager only)."""
        return self._fields[step]

    def fields(self, record: dict[str, Any], times: Any, records: list[dict[str, Any]]) -> dict[str, Any]:
        if self.eager:
            return self._fields.pop(int(record["step"]))
        sums = self._sums.pop(int(record["step"]))  # after_step of this step came first
        grad_sq, trace = estimate(sums.tolist(), float(record["items"]), self.world)
        return record_fields(grad_sq, trace, records[-1] if records else None, self.decay)
