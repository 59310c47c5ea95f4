"""``distaccum plan --island-link-gbps B``: how rarely R islands joined by a slow link must sync (DiLoCo,
LocalSGD: the ``outer`` config section) for the sync to hide behind the islands' own steps. A **prediction**
from the α–β model of :mod:`distaccum.tuning.collectives`, never a measurement; pure functions, no torch.

Every H optimizer steps each island ring-all-reduces its P parameters (the pseudo-gradient, or the parameters
for LocalSGD) at b bytes each across the R islands. Streaming DiLoCo cuts them into F fragments synced at
staggered offsets: fragment p of P/F parameters after floor((p+1)H/F) steps, then every H (as training does:
:meth:`distaccum.outer.config.OuterConfig.offsets`), so two fragment syncs are floor(H/F) or ceil(H/F) steps apart
(H/F when F divides H), each overlapped with the steps until the next. With ``s`` one optimizer step inside a
island and the island's link (α, β):

    one sync       t(H) = 2(R-1) α + 2 (R-1)/R · P b / (F β)          (ring all-reduce of one fragment)
    hidden behind  floor(H/F) s                                        (the shortest gap until the next fragment)
    exposed        max(0, t - floor(H/F) s) · F / H                    per step (at most: longer gaps hide more)
    smallest H     F · ceil(t / s)                                     (a multiple of F: exposed = 0)
    bytes / step   2 (R-1)/R · P b / H                                 sent by each island over its link

The synchronous run it replaces (HSDP with one replica per island: a gradient all-reduce across them every step,
g bytes per parameter) sends 2 (R-1)/R · P g per step: the outer sync sends H g / b times fewer bytes.

Not modelled: the outer optimizer's own step, inner collectives sharing the slow link, a sync slowing the
compute it overlaps, and what H does to convergence (that is a training question, not a timing one).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from distaccum.tuning.collectives import Link, ring, ring_terms
from distaccum.tuning.scaleout import duration, rate
from distaccum.units import human_bytes

OUTER_BYTES = {"fp32": 4.0, "bf16": 2.0}
"""Bytes per parameter of the outer sync, by ``outer.reduce_dtype``."""
SHOWN_EVERY = (1, 10, 50, 100, 500)
"""The H values the table always shows (each rounded up to a multiple of F)."""


@dataclass(frozen=True, kw_only=True)
class OuterLinkPlan:
    """R islands, the link joining them, and the work between two syncs."""

    params: int
    """P: parameters of the model (every island holds all of them)."""
    islands: int
    """R: islands in the ring (each holds a whole model)."""
    link: Link
    """One island's link to the others (all its NICs together), each way."""
    step_s: float
    """One optimizer step inside an island, seconds: the time a sync can hide behind, per step."""
    bytes_per_param: float = 4.0
    """b: bytes per parameter the outer sync moves (4: fp32, 2: bf16)."""
    fragments: int = 1
    """F: fragments synced at staggered offsets, one every H/F steps (1: the whole model every H steps)."""
    sync_bytes_per_param: float = 4.0
    """g: bytes per parameter of the synchronous run's per-step gradient all-reduce across islands."""

    def __post_init__(self) -> None:
        if min(self.params, self.islands, self.fragments) < 1:
            raise ValueError(
                f"params, islands and fragments must be >= 1, got params={self.params}, "
                f"islands={self.islands}, fragments={self.fragments}"
            )
        if self.step_s < 0 or self.bytes_per_param <= 0 or self.sync_bytes_per_param <= 0:
            raise ValueError(
                f"step_s must be >= 0 and bytes per parameter > 0, got step_s={self.step_s}, "
                f"bytes_per_param={self.bytes_per_param}, sync_bytes_per_param={self.sync_bytes_per_param}"
            )

    def check_every(self, every: int) -> None:
        """ValueError unless ``every`` (H) is at least the fragments (training's own rule: each fragment syncs at a
        step of its own)."""
        if every < self.fragments:
            raise ValueError(
                f"H={every} must be at least the {self.fragments} fragment(s): fragment p syncs after "
                f"floor((p+1) x H/{self.fragments}) steps, a step of its own"
            )

    def fragment_bytes(self) -> float:
        """Bytes of one fragment on each island: P b / F."""
        return self.params * self.bytes_per_param / self.fragments

    def sync_s(self) -> float:
        """One fragment's ring all-reduce across the islands (0 with one island)."""
        return ring("all_reduce", self.fragment_bytes(), self.islands, self.link)

    def synchronous_bytes_per_step(self) -> float:
        """What each island sends per step in the synchronous run: 2 (R-1)/R · P g."""
        return ring_terms("all_reduce", self.params * self.sync_bytes_per_param, self.islands)[1]

    def synchronous_s(self) -> float:
        """The synchronous run's per-step gradient all-reduce on the same link, seconds."""
        return ring("all_reduce", self.params * self.sync_bytes_per_param, self.islands, self.link)


@dataclass(frozen=True)
class OuterRow:
    """The outer sync at one H: predicted, never measured."""

    every: int
    """H: optimizer steps between two syncs of a fragment."""
    bytes_per_step: float
    """Bytes each island sends over its link per optimizer step."""
    sync_s: float
    """One fragment's sync."""
    window_s: float
    """The compute it hides behind: H/F steps."""
    exposed_per_step_s: float
    """Sync time the steps cannot hide, spread over the steps."""
    reduction: float | None
    """The synchronous run's bytes per step over these (None with one island: nothing crosses)."""

    @property
    def hidden(self) -> bool:
        """The sync hides entirely behind the steps."""
        return self.exposed_per_step_s == 0


def outer_row(sync: OuterLinkPlan, every: int) -> OuterRow:
    """The outer sync every ``every`` steps (the formulas of the module docstring)."""
    sync.check_every(every)
    gap = every // sync.fragments  # the shortest run of steps between two fragment syncs
    t, window = sync.sync_s(), gap * sync.step_s
    syncs_per_step = sync.fragments / every
    sent = ring_terms("all_reduce", sync.fragment_bytes(), sync.islands)[1] * syncs_per_step
    baseline = sync.synchronous_bytes_per_step()
    return OuterRow(
        every,
        sent,
        t,
        window,
        max(0.0, t - window) * syncs_per_step,
        baseline / sent if sent > 0 else None,
    )


def smallest_hidden_every(sync: OuterLinkPlan) -> int | None:
    """The smallest H, a multiple of F, whose sync hides behind its H/F steps; None when nothing hides it
    (steps of 0 seconds)."""
    t = sync.sync_s()
    if t == 0:
        return sync.fragments
    if sync.step_s == 0:
        return None
    period = max(1, math.ceil(t / sync.step_s))
    while period > 1 and t <= (period - 1) * sync.step_s:  # the division rounded up a whole step
        period -= 1
    while t > period * sync.step_s:  # or one short
        period += 1
    return period * sync.fragments


def shown_every(sync: OuterLinkPlan, extra: Iterable[int | None] = ()) -> list[int]:
    """The H values of the table: :data:`SHOWN_EVERY` rounded up to multiples of F, and ``extra``."""
    f = sync.fragments
    values = {math.ceil(h / f) * f for h in SHOWN_EVERY} | {h for h in extra if h is not None}
    return sorted(values)


def render_outer(sync: OuterLinkPlan, every: int | None, *, step_basis: str, link_basis: str) -> str:
    """The outer-sync prediction as text: what it assumes, the smallest hidden H, a row per H (the table's,
    ``every`` and the smallest), and the synchronous run it replaces. Every row says it is a prediction."""
    smallest = smallest_hidden_every(sync)
    r, f = sync.islands, sync.fragments
    lines = [
        f"OUTER SYNC PREDICTION (DiLoCo / LocalSGD across {r} islands): not a measurement; the α–β model of "
        "distaccum/tuning/outer_plan.py.",
        f"link between islands: {rate(sync.link.beta_bytes_per_s)} per island, α "
        f"{sync.link.alpha_s * 1e3:g} ms ({link_basis})",
        f"sync: every H steps each island ring-all-reduces {sync.params:,} parameters x "
        f"{sync.bytes_per_param:g} B = {human_bytes(sync.params * sync.bytes_per_param)} across the {r} "
        f"islands, "
        + (
            f"in {f} fragments of {human_bytes(sync.fragment_bytes())}, one every H/{f} steps, overlapped with "
            f"the next H/{f} steps: {duration(sync.sync_s())} per fragment sync"
            if f > 1
            else f"overlapped with the next H steps: {duration(sync.sync_s())} per sync"
        ),
        f"step inside an island: {duration(sync.step_s)} ({step_basis})",
    ]
    if r == 1:
        lines.append("one island: nothing crosses the link, any H hides the sync")
    elif smallest is None:
        lines.append("no H hides the sync: the step inside an island takes no time (--compute-ms 0?)")
    else:
        lines.append(
            f"smallest H with the sync hidden: H = {smallest} ({'a fragment' if f > 1 else 'a'} sync of "
            f"{duration(sync.sync_s())} behind {smallest // f} step{'s' if smallest // f > 1 else ''} of "
            f"{duration(sync.step_s)}); smaller H leave part of every sync exposed"
        )
    lines += [
        "",
        "| H | sent per island per step | one sync | hidden behind | exposed per step | step | "
        "bytes vs synchronous | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for h in shown_every(sync, (every, smallest)):
        row = outer_row(sync, h)
        marks = [m for m, on in (("smallest hidden", h == smallest), ("--outer-every", h == every)) if on]
        fewer = _ratio(row.reduction)
        lines.append(
            f"| {h}{' (' + ', '.join(marks) + ')' if marks else ''} | {human_bytes(row.bytes_per_step)} | "
            f"{duration(row.sync_s)} | {duration(row.window_s)} | {duration(row.exposed_per_step_s)} | "
            f"{duration(sync.step_s + row.exposed_per_step_s)} | {fewer} | predicted |"
        )
    lines += [
        "",
        f"synchronous (HSDP with one replica per island: a gradient all-reduce across the {r} replicas every step, "
        f"{sync.sync_bytes_per_param:g} B/param): {human_bytes(sync.synchronous_bytes_per_step())} sent per "
        f"island per step, {duration(sync.synchronous_s())} per step on this link",
    ]
    return "\n".join(lines)


def _ratio(reduction: float | None) -> str:
    if reduction is None:
        return "-"
    if math.isclose(reduction, 1.0):
        return "same"
    return f"{reduction:,.4g}x fewer" if reduction > 1 else f"{1 / reduction:,.4g}x more"
