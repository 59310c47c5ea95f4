"""How far a DiLoCo candidate's first outer step moved, against the simulator's: the merge's factor.

At fragment p's first sync (after step s) the outer optimizer's momentum buffer is empty and theta_g is still the
seed checkpoint's theta_0, so the outer SGD step is linear in the merged pseudo-gradient dbar (torch's SGD: the
buffer starts as dbar; Nesterov steps along dbar + mu dbar):

    theta_g(s) = theta_0 - lr (1 + mu) dbar        (without Nesterov: theta_0 - lr dbar)

When every step before s matched the simulator, the islands' parameters before the merge, and with them dbar, are
the simulator's. A candidate whose merge is off by a factor f (it applies f dbar) ends at theta_0 - lr (1 + mu) f
dbar, and the per-tensor sums of ``param_digests.jsonl`` are linear too:

    sum_cand(s) - sum_0 = f (sum_ref(s) - sum_0)        for every tensor of the fragment

so f is the least-squares slope over the fragment's tensors, returned with the part of the candidate's movement it
leaves unexplained (relative, as a norm over the tensors: 0 when the candidate's merge is exactly f times the
simulator's). f = 1 is a correct merge, f = -1 a pseudo-gradient of the wrong sign, f = R (the islands) their SUM
used as the mean; :func:`distaccum.verify.diagnosis.rule_outer_merge` names them only when f is that close to -1 or R
and the residual that small (its docstring derives the bound). A merge that weighs the islands otherwise than the
simulator (equal weights where their token counts differ) is no constant multiple of it: a residual, and a slope off
-1 or R by about as much.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from distaccum.config import RunConfig
from distaccum.outer.islands import resolve_islands
from distaccum.outer.sync import split_fragments
from distaccum.rundir.weights import load_weights
from distaccum.verify.compare import Report


def seed_sums(path: Path) -> dict[str, float]:
    """The fp64 sum of every tensor of the seed checkpoint at ``path``."""
    return {name: float(t.to(torch.float64).sum()) for name, t in load_weights(path).items()}


def first_sync(cfg: RunConfig, step: int, digests: dict[str, list[float]]) -> list[str]:
    """The parameters whose fragment syncs for the first time after ``step`` (empty: no fragment does). The
    fragments are the run's cut of the parameters in ``digests``' order (its element counts)."""
    offsets = cfg.outer.offsets()
    due = [p for p in cfg.outer.syncing(step, cfg.trainer.max_steps) if offsets[p] >= step]
    if not due:
        return []
    names = list(digests)
    groups = split_fragments([int(v[2]) for v in digests.values()], cfg.outer.fragments)
    return [names[i] for p in due for i in groups[p]]


def merge_factor(
    seed: dict[str, float],
    ref: dict[str, list[float]],
    cand: dict[str, list[float]],
    names: list[str],
) -> tuple[float, float] | None:
    """(f, residual): the least-squares slope of the candidate's movement from the seed over the reference's, tensor
    by tensor, and ||c - f r|| / ||c||, what of the candidate's movement c that slope leaves unexplained (module
    docstring); None when the reference did not move (no slope) or the candidate did not."""
    pairs = [
        (cand[n][0] - seed[n], ref[n][0] - seed[n]) for n in names if n in seed and n in ref and n in cand
    ]
    moved = math.fsum(r * r for _, r in pairs)
    own = math.fsum(c * c for c, _ in pairs)
    if not pairs or moved <= 0 or own <= 0:
        return None
    f = math.fsum(c * r for c, r in pairs) / moved
    return f, math.sqrt(math.fsum((c - f * r) ** 2 for c, r in pairs) / own)


def outer_merge_fact(
    cfg: RunConfig,
    world_size: int,
    seed: Path,
    report: Report,
    ref: dict[int, dict[str, list[float]]],
    cand: dict[int, dict[str, list[float]]],
) -> tuple[int, float, int, float] | None:
    """(step, f, islands, residual) when a diloco candidate first parts from the simulator in its parameters right
    after a fragment's first sync, every earlier step and that step's loss and gradient norm matching; None
    otherwise."""
    d = report.first_divergence
    if cfg.outer.method != "diloco" or d is None or d.quantity != "parameter":
        return None
    if d.step not in ref or d.step not in cand or not seed.is_file():
        return None
    names = first_sync(cfg, d.step, ref[d.step])
    fit = merge_factor(seed_sums(seed), ref[d.step], cand[d.step], names) if names else None
    if fit is None:
        return None
    return d.step, fit[0], resolve_islands(cfg.outer.islands, world_size, 1), fit[1]
