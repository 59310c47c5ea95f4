"""The global batch's growth: ``accum.ramp`` and ``accum.adaptive`` (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports it) only to keep that module under 500 lines; like
:mod:`distaccum.split` it imports nothing of distaccum. What the settings mean is :mod:`distaccum.batching.growth`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class RampConfig:
    """Grow the global batch during training by accumulating more micro-batches (K), the micro-batch fixed.

    Two forms; the ramp ends at ``accum.global_batch`` (which it needs) and stays there:

    - Megatron-LM's ``--rampup-batch-size START INCR SAMPLES``: ``start``, ``increment``, ``samples``. The batch
      starts at ``start`` and grows by ``increment`` each time another samples / ((global_batch - start) /
      increment) samples have been consumed, reaching ``accum.global_batch`` after ``samples`` samples.
    - ``points``: ``[[step, global_batch], ...]``, 1-based optimizer steps from which each global batch holds;
      the first at step 1, the last one's batch ``accum.global_batch``.
    """

    start: int | None = None
    """Global batch at step 1 (Megatron form); null: no ramp of this form."""
    increment: int | None = None
    """Samples the global batch grows by at each increment (Megatron form)."""
    samples: int | None = None
    """Samples consumed over which the batch grows from start to accum.global_batch (Megatron form)."""
    points: list[list[int]] | None = None
    """[[step, global_batch], ...]: from 1-based optimizer step ``step`` on, ``global_batch`` samples per step."""

    def __post_init__(self) -> None:
        megatron = [self.start, self.increment, self.samples]
        if any(v is not None for v in megatron) and self.points is not None:
            raise ValueError(
                "accum.ramp: give either start/increment/samples (Megatron's --rampup-batch-size) or points, not both"
            )
        if any(v is not None for v in megatron) and not all(v is not None for v in megatron):
            raise ValueError(
                f"accum.ramp needs start, increment and samples together (Megatron's --rampup-batch-size START "
                f"INCR SAMPLES), got start={self.start}, increment={self.increment}, samples={self.samples}"
            )
        for name, value in (("start", self.start), ("increment", self.increment), ("samples", self.samples)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"accum.ramp.{name} must be a positive integer, got {value!r}")
        if self.points is not None:
            pairs = [list(p) for p in self.points]
            if not pairs or any(
                len(p) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in p)
                for p in pairs
            ):
                raise ValueError(
                    f"accum.ramp.points must be a non-empty list of [step, global_batch] pairs of positive integers, "
                    f"got {self.points!r}"
                )
            steps = [p[0] for p in pairs]
            if steps[0] != 1 or steps != sorted(set(steps)):
                raise ValueError(
                    f"accum.ramp.points must start at step 1 and list strictly increasing steps, got steps {steps}"
                )
            self.points = pairs

    @property
    def enabled(self) -> bool:
        """Whether a ramp is configured."""
        return self.start is not None or self.points is not None


@dataclass(kw_only=True)
class AdaptiveConfig:
    """Let the measured gradient noise scale choose the global batch (opt-in; needs ``log.gns=true``).

    Every ``every`` steps (from step ``warmup`` on) the smoothed simple noise scale ``gns_smoothed`` (loss items),
    converted to samples by the last step's items per sample, becomes the target; the next global batch is the
    multiple of micro_batch x world nearest to it (a whole K), at most ``max_factor`` times (at least
    1/``max_factor``) the current one, within [min_batch, max_batch]. A negative or undefined estimate keeps the
    batch. Every rank computes the rule on the same reduced numbers; the decision is compared across ranks."""

    enabled: bool = False
    """Follow the noise scale (accum.global_batch is the batch until the first change)."""
    min_batch: int | None = None
    """Smallest global batch (null: micro_batch x world, K = 1)."""
    max_batch: int | None = None
    """Largest global batch (null: 8 x accum.global_batch)."""
    every: int = 50
    """Optimizer steps between two changes (the batch changes at most this often)."""
    warmup: int = 50
    """No change before this optimizer step (the noise-scale average needs steps to settle)."""
    max_factor: float = 2.0
    """A change multiplies or divides the global batch by at most this."""

    def __post_init__(self) -> None:
        for name, value in (("every", self.every), ("warmup", self.warmup)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"accum.adaptive.{name} must be a positive integer, got {value!r}")
        for name, bound in (("min_batch", self.min_batch), ("max_batch", self.max_batch)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound <= 0):
                raise ValueError(f"accum.adaptive.{name} must be a positive integer or null, got {bound!r}")
        if self.min_batch is not None and self.max_batch is not None and self.min_batch > self.max_batch:
            raise ValueError(
                f"accum.adaptive.min_batch={self.min_batch} is above accum.adaptive.max_batch={self.max_batch}"
            )
        if not float(self.max_factor) > 1.0:
            raise ValueError(f"accum.adaptive.max_factor must be > 1, got {self.max_factor!r}")

    def bounds(self, unit: int, global_batch: int) -> tuple[int, int]:
        """(smallest, largest) global batch the rule may choose: ``min_batch`` rounded up and ``max_batch`` down onto
        multiples of ``unit`` = micro_batch x world (defaults: one K, 8 x the starting ``global_batch``)."""
        lo = self.min_batch if self.min_batch is not None else unit
        hi = self.max_batch if self.max_batch is not None else 8 * global_batch
        lo, hi = max(unit, -(-lo // unit) * unit), max(unit, hi // unit * unit)
        if lo > hi:
            raise ValueError(
                f"accum.adaptive bounds [{self.min_batch}, {self.max_batch}] hold no multiple of micro_batch x world "
                f"= {unit}"
            )
        return lo, hi


def check_growth(ramp: RampConfig, adaptive: AdaptiveConfig, global_batch: int | None) -> None:
    """The ``accum`` section's checks of its growth: one at most, and a global batch for it to start or end at."""
    if ramp.enabled and adaptive.enabled:
        raise ValueError("accum.ramp and accum.adaptive.enabled=true exclude each other: choose one")
    if (ramp.enabled or adaptive.enabled) and global_batch is None:
        raise ValueError(
            "accum.ramp / accum.adaptive need accum.global_batch (the ramp's end, the adaptive start)"
        )
