"""The ``outer`` config section: reduce across model replicas only every H optimizer steps (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports it) only to keep that module under 500 lines; like
:mod:`distaccum.split` it imports nothing of distaccum.
"""

from __future__ import annotations

from dataclasses import dataclass

OUTER_METHODS = ("none", "local_sgd", "diloco")
OUTER_REDUCE_DTYPES = ("fp32", "bf16")
OUTER_WEIGHTINGS = ("tokens", "equal")


@dataclass(kw_only=True)
class OuterConfig:
    """Reduce across model replicas every ``every`` optimizer steps instead of every step (docs/outer.md).

    The ranks form ``replicas`` islands of world/replicas ranks. Inside an island every optimizer step is today's
    accumulation step (DDP or FSDP2 over the island's ranks only). Across islands nothing is exchanged between
    syncs; at a sync each island's contribution is merged, weighted by the loss items it trained on since the last
    sync of that fragment: local_sgd averages the parameters, diloco averages the pseudo-gradient (global minus
    local parameters) and applies it with an outer SGD (Nesterov momentum by default)."""

    method: str = "none"
    """none (every optimizer step reduces over all ranks) | local_sgd (average the parameters every H steps) |
    diloco (inner optimizer steps, then the outer optimizer on the averaged pseudo-gradient every H steps)."""
    every: int = 50
    """H: optimizer steps between two syncs of a fragment (of the whole model when fragments=1)."""
    replicas: int | str = "auto"
    """Islands (model replicas) the ranks form, each of world/replicas consecutive ranks. auto: one per node when
    the launch spans several nodes, else one per rank."""
    fragments: int = 1
    """P: the parameters in P fragments (consecutive parameters of about equal size) synced at staggered offsets,
    fragment p after steps floor((p+1) H/P), then every H steps (streaming DiLoCo); at most every."""
    lr: float = 0.7
    """Outer learning rate (diloco)."""
    momentum: float = 0.9
    """Outer SGD momentum (diloco); 0 for none."""
    nesterov: bool = True
    """Nesterov momentum for the outer SGD (diloco; needs momentum > 0)."""
    reduce_dtype: str = "fp32"
    """fp32 | bf16: the dtype the pseudo-gradient (local_sgd: the parameters) crosses between islands in."""
    weighting: str = "tokens"
    """tokens: each island's contribution weighted by the loss items it trained on since the fragment's last sync
    (the plain mean when every island held the same); equal: the plain mean."""

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("method", self.method, OUTER_METHODS),
            ("reduce_dtype", self.reduce_dtype, OUTER_REDUCE_DTYPES),
            ("weighting", self.weighting, OUTER_WEIGHTINGS),
        ):
            if value not in allowed:
                raise ValueError(f"outer.{name}={value!r} is not one of {', '.join(allowed)}")
        if self.replicas != "auto" and (
            isinstance(self.replicas, (str, bool)) or not isinstance(self.replicas, int) or self.replicas < 1
        ):
            raise ValueError(f"outer.replicas must be a positive integer or 'auto', got {self.replicas!r}")
        for key, number in (("every", self.every), ("fragments", self.fragments)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"outer.{key} must be a positive integer, got {number!r}")
        if self.fragments > self.every:
            raise ValueError(
                f"outer.fragments={self.fragments} is more than outer.every={self.every}: each fragment syncs at a "
                "step of its own within every H steps"
            )
        if self.lr <= 0:
            raise ValueError(f"outer.lr must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"outer.momentum must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ValueError("outer.nesterov=true needs outer.momentum > 0 (set outer.nesterov=false)")

    def describe(self) -> str:
        """One line: the method and its settings."""
        merge = f"{self.weighting}-weighted, {self.reduce_dtype} across islands"
        if self.fragments > 1:
            merge += f", {self.fragments} fragments at staggered offsets"
        if self.method == "local_sgd":
            return f"LocalSGD: the parameters averaged, {merge}"
        momentum = (
            f", momentum {self.momentum:g}{' Nesterov' if self.nesterov else ''}" if self.momentum else ""
        )
        return f"DiLoCo: outer SGD lr {self.lr:g}{momentum} on the averaged pseudo-gradient, {merge}"

    @property
    def enabled(self) -> bool:
        """A method other than none."""
        return self.method != "none"

    def offsets(self) -> list[int]:
        """Each fragment's first sync step: floor((p+1) H/P) (spread as evenly as whole steps allow)."""
        return [(p + 1) * self.every // self.fragments for p in range(self.fragments)]

    def syncing(self, step: int, max_steps: int) -> list[int]:
        """The fragments that sync after optimizer step ``step`` (1-based): fragment p when step = its offset mod H;
        every fragment after the last step (the closing sync: the trained model is the global one)."""
        if step >= max_steps:
            return list(range(self.fragments))
        return [p for p, first in enumerate(self.offsets()) if step % self.every == first % self.every]
