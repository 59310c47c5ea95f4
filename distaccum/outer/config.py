"""The ``outer`` config section: reduce across islands only every H optimizer steps (a leaf module).

Kept apart from :mod:`distaccum.config` (which imports it) only to keep that module under 500 lines; like
:mod:`distaccum.split` it imports nothing of distaccum.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

OUTER_METHODS = ("none", "local_sgd", "diloco")
OUTER_REDUCE_DTYPES = ("fp32", "bf16")
OUTER_WEIGHTINGS = ("tokens", "equal")
RENAMED_KEYS = {"outer.replicas": "outer.islands"}
"""Old config keys -> their names now, accepted for one release (a replica is HSDP's, ``engine.replicas``; an outer
sync's group is an island). Configurations, overrides and checkpoints' records written with the old key still
read."""


def renamed_keys(values: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``values`` (a nested config mapping) with each old key of :data:`RENAMED_KEYS` moved to its new name, and
    one line per old key given saying what to write instead. An old key holding None (the slot the composed
    defaults keep for it, so overrides and YAML may still name it) is dropped."""
    out = dict(values)
    notes = []
    for old, new in RENAMED_KEYS.items():
        (section, leaf), (_, new_leaf) = old.split("."), new.split(".")
        node = out.get(section)
        if not isinstance(node, Mapping) or leaf not in node:
            continue
        node = dict(node)
        value = node.pop(leaf)
        if value is not None:
            node[new_leaf] = value
            notes.append(f"{old} is now {new}: write {new}={value} (the old key is accepted for one release)")
        out[section] = node
    return out, notes


@dataclass(kw_only=True)
class OuterConfig:
    """Reduce across islands every ``every`` optimizer steps instead of every step (docs/outer.md).

    The ranks form ``islands`` islands of world/islands ranks. Inside an island every optimizer step is today's
    accumulation step (DDP or FSDP2 over the island's ranks only). Across islands nothing is exchanged between
    syncs; at a sync each island's contribution is merged, weighted by the loss items it trained on since the last
    sync of that fragment: local_sgd averages the parameters, diloco averages the pseudo-gradient (global minus
    local parameters) and applies it with an outer SGD (Nesterov momentum by default)."""

    method: str = "none"
    """none (every optimizer step reduces over all ranks) | local_sgd (average the parameters every H steps) |
    diloco (inner optimizer steps, then the outer optimizer on the averaged pseudo-gradient every H steps)."""
    every: int = 50
    """H: optimizer steps between two syncs of a fragment (of the whole model when fragments=1)."""
    islands: int | str = "auto"
    """Islands (groups of ranks that train apart between outer syncs), each of world/islands consecutive ranks.
    auto: one per node when the launch spans several nodes, else one per rank."""
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
        if self.islands != "auto" and (
            isinstance(self.islands, (str, bool)) or not isinstance(self.islands, int) or self.islands < 1
        ):
            raise ValueError(f"outer.islands must be a positive integer or 'auto', got {self.islands!r}")
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
