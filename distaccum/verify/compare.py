"""Verification: does an accumulated, distributed run compute what one process on the whole batch does?

The file format is tiny and shared with training: every run writes ``metrics.jsonl`` (loss and
grad_norm per optimizer step) and ``final/model.safetensors`` (the trained weights); a run launched
with ``verify.record=true`` also writes ``param_digests.jsonl`` (fp64 sum and sum of squares of every
parameter after every step, from the tripwire in :mod:`distaccum.guards.tripwire`). The reference is
:mod:`distaccum.verify.reference`: plain PyTorch, independent of the loop it checks.

:func:`compare` turns a reference and a candidate run into a :class:`Report` naming the first
diverging step and parameter. The criterion for any compared quantity (a scalar series or one
parameter tensor) is

    max |candidate - reference|  <=  atol + rtol * max |reference|

so ``max_rel_diff`` is relative to the tensor's scale, not element by element (elements near zero
would make an element-wise ratio meaningless). The diagnosis rules in :mod:`distaccum.verify.diagnosis`
explain a mismatch; :mod:`distaccum.verify.runner` launches the runs and reports.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from distaccum.config import VerifyConfig
from distaccum.guards.tripwire import read_divergence
from distaccum.rundir import CONSOLE_LOG, final_weights, read_metrics, read_param_digests, read_warnings
from distaccum.rundir.weights import load_weights


@dataclass(frozen=True)
class Tolerance:
    """A quantity passes when ``max|cand - ref| <= atol + rtol * max|ref|``."""

    rtol: float
    atol: float

    def bound(self, scale: float) -> float:
        """The largest absolute difference allowed for a quantity of magnitude ``scale``."""
        return self.atol + self.rtol * scale

    def __str__(self) -> str:
        return f"{self.atol:g} + {self.rtol:g} * max|ref|"


@dataclass(frozen=True)
class Tolerances:
    """One precision's tolerances: per-step metrics and final parameters are held to different bars.

    loss and grad_norm are reductions over the whole batch, so reordered sums change them only at
    the precision's rounding level. A parameter whose true gradient is ~0 (e.g. the key bias of
    attention: softmax ignores it) receives pure rounding noise, which AdamW divides by
    sqrt(v) + eps and turns into updates of up to ~lr: in fp32 such a tensor drifts ~1e-4 from the
    reference after 30 steps (measured, docs/verify.md) while every other tensor agrees to ~1e-6.
    """

    steps: Tolerance
    params: Tolerance


DEFAULT_TOLERANCES: dict[str, Tolerances] = {
    # fp64: measured differences ~1e-15; bugs show at >= 1e-3.
    "fp64": Tolerances(steps=Tolerance(rtol=1e-9, atol=1e-12), params=Tolerance(rtol=1e-9, atol=1e-12)),
    # fp32: measured loss/grad_norm <= 3e-7 relative, parameters <= 7e-4 (see Tolerances).
    "fp32": Tolerances(steps=Tolerance(rtol=1e-4, atol=1e-6), params=Tolerance(rtol=5e-3, atol=1e-5)),
    "bf16": Tolerances(steps=Tolerance(rtol=2e-2, atol=1e-3), params=Tolerance(rtol=5e-2, atol=1e-3)),
    "fp16": Tolerances(steps=Tolerance(rtol=2e-2, atol=1e-3), params=Tolerance(rtol=5e-2, atol=1e-3)),
}


UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
"""Unit roundoff u = 2^-p of the reduced dtypes, p their significand bits with the implicit one (bf16: 8,
fp16: 11): rounding x to the dtype gives x (1 + d) with |d| <= u."""


def reduction_roundings(sync: str, world_size: int, accum_steps: int) -> int:
    """n: how many reduced-precision roundings one optimizer step's reduction applies to a gradient element,
    at most. One all-reduce (or reduce-scatter + all-reduce) over W ranks rounds each rank's contribution
    once when it is cast and every partial sum once per addition: W - 1 additions, whatever the ring or tree
    order, so W. ``boundary`` reduces once per step: n = W. ``every_micro`` and ``replica_boundary`` reduce K
    times (DDP re-rounds the accumulated bucket each time; FSDP2 rounds each micro-batch's share, and under
    ``replica_boundary`` keeps the partial sum across micro-batches in the reduced dtype): n = K W."""
    return world_size if sync == "boundary" else world_size * accum_steps


def with_reduction(
    tol: Tolerances,
    reduce_dtype: str,
    roundings: int,
    *,
    lr: float,
    steps: int,
    adam_betas: tuple[float, float] | None,
) -> Tolerances:
    """``tol`` widened for gradients reduced in ``reduce_dtype`` (``accum.reduce_dtype``), derived:

    - The reduced gradient is the exact one with a relative error of at most e = n u per element to first
      order (n = :func:`reduction_roundings`, u = :data:`UNIT_ROUNDOFF`), relative to the sum of the ranks'
      contributions' magnitudes: the gradient's own magnitude where they do not cancel.
    - ``grad_norm`` is the norm of that gradient: |norm(g') - norm(g)| <= norm(g' - g) <= e norm(g), so the
      per-step tier's rtol grows by e. The loss moves only through the parameters: far less.
    - Parameters, Adam(W) (``adam_betas`` given): an element whose ranks' contributions cancel has no relative
      bound (its reduced value may change sign), and Adam's update lr m/(sqrt(v) + eps) has the same size
      whatever the gradient's: at most k lr per element and step, k = max(1, (1 - b1) / sqrt(1 - b2))
      (Kingma & Ba 2015, section 2.1). Two runs whose gradients differ anywhere thus differ by at most
      2 k lr per element and step: the parameter tier's atol grows by 2 k lr T after T steps (``lr``: the
      peak learning rate). Measured: 0.16 of it on the 0.1M-parameter MLP at K=16 (docs/multinode.md).
    - Parameters, SGD: the update is linear in the gradient, so the parameters' movement carries the relative
      error e of the gradients, first order: the tier's rtol grows by 2 e.
    ``fp32`` (no compression) returns ``tol`` unchanged.
    """
    if reduce_dtype not in UNIT_ROUNDOFF:
        return tol
    e = roundings * UNIT_ROUNDOFF[reduce_dtype]
    steps_tol = Tolerance(rtol=tol.steps.rtol + e, atol=tol.steps.atol)
    if adam_betas is None:
        return Tolerances(
            steps=steps_tol, params=Tolerance(rtol=tol.params.rtol + 2 * e, atol=tol.params.atol)
        )
    b1, b2 = adam_betas
    k = max(1.0, (1 - b1) / math.sqrt(1 - b2))
    return Tolerances(
        steps=steps_tol, params=Tolerance(rtol=tol.params.rtol, atol=tol.params.atol + 2 * k * lr * steps)
    )


def tolerance_for(precision: str, verify: VerifyConfig) -> Tolerances:
    """The default for ``precision``; ``verify.rtol`` / ``verify.atol``, when set, replace both tiers."""
    base = DEFAULT_TOLERANCES[precision]

    def override(tol: Tolerance) -> Tolerance:
        return Tolerance(
            rtol=tol.rtol if verify.rtol is None else verify.rtol,
            atol=tol.atol if verify.atol is None else verify.atol,
        )

    return Tolerances(steps=override(base.steps), params=override(base.params))


# --- files written by the runs ---------------------------------------------------------------------


@dataclass
class RunData:
    """What verify reads back from one run directory."""

    run_dir: Path
    records: list[dict[str, Any]]
    digests: dict[int, dict[str, list[float]]]
    """step -> parameter -> [sum, sum of squares, numel]."""
    params: dict[str, torch.Tensor] | None
    divergence: dict[str, Any] | None
    """The tripwire's (or the fingerprint's) report when ranks diverged (:mod:`distaccum.guards.tripwire`)."""
    warnings: list[dict[str, Any]] = field(default_factory=list)
    """The runtime checks' warnings (:mod:`distaccum.guards.fingerprint`)."""
    console: str = ""
    """The last lines of its ``console.log`` (a verify sub-run's output), when there is one."""

    @classmethod
    def load(cls, run_dir: Path) -> RunData:
        """Read whatever the run left (a failed run may have fewer steps and no final parameters)."""
        weights = final_weights(run_dir)
        params = load_weights(weights) if weights.is_file() else None
        log = run_dir / CONSOLE_LOG
        console = "\n".join(log.read_text(errors="replace").splitlines()[-200:]) if log.is_file() else ""
        return cls(
            run_dir,
            read_metrics(run_dir),
            read_param_digests(run_dir),
            params,
            read_divergence(run_dir),
            read_warnings(run_dir),
            console,
        )


# --- comparison -----------------------------------------------------------------------------------


@dataclass
class Divergence:
    """Where a tolerance was first exceeded."""

    step: int
    """1-based optimizer step (parameters: after that step)."""
    quantity: str
    """loss | grad_norm | parameter | ranks (the tripwire) | missing (the run stopped early)."""
    parameter: str | None
    """The parameter over tolerance, or (for loss/grad_norm) whose digest moved furthest that step."""
    reference: float | None = None
    candidate: float | None = None
    abs_diff: float | None = None


@dataclass
class Report:
    """The comparison of one candidate with the reference."""

    passed: bool
    steps_compared: int
    max_abs_diff: float
    """Largest |cand - ref| over every element of every final parameter (nan if none compared)."""
    max_rel_diff: float
    """Largest per-tensor max|cand - ref| / max|ref| over final parameters."""
    worst_parameter: str | None
    max_loss_diff: float
    max_grad_norm_diff: float
    first_divergence: Divergence | None
    notes: list[str] = field(default_factory=list)
    bitwise: bool = False
    """The final parameters have the reference's bits (``accum.exact``: compared by their SHA-256)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _scalar_gap(a: float, b: float, tol: Tolerance) -> tuple[float, bool]:
    diff = abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf
    return diff, diff > tol.bound(abs(b))


def digest_gaps(
    ref: dict[str, list[float]], cand: dict[str, list[float]], tol: Tolerance
) -> list[tuple[float, str, bool]]:
    """Per parameter: (gap / allowed, name, proven over tolerance), largest gap first.

    From (sum, sum of squares) alone, |Δsum|/n and |‖c‖-‖r‖|/√n are lower bounds of max|c - r|,
    and ‖r‖ is an upper bound of max|r|: a gap above ``atol + rtol*‖r‖`` proves the tensor is over
    tolerance (no false alarms; small differences may go unnoticed until the final comparison).
    """
    out = []
    for name, (r_sum, r_sq, n) in ref.items():
        if name not in cand:
            out.append((math.inf, name, True))
            continue
        c_sum, c_sq, _ = cand[name]
        r_norm, c_norm = math.sqrt(max(r_sq, 0.0)), math.sqrt(max(c_sq, 0.0))
        lower = max(abs(c_sum - r_sum) / n, abs(c_norm - r_norm) / math.sqrt(n))
        proven = not (lower <= tol.bound(r_norm))  # nan counts as over
        rms = r_norm / math.sqrt(n)
        ratio = lower / tol.bound(rms) if tol.bound(rms) > 0 else math.inf
        out.append((ratio if not math.isnan(ratio) else math.inf, name, proven))
    return sorted(out, key=lambda t: -t[0])


def compare_params(
    ref: dict[str, torch.Tensor], cand: dict[str, torch.Tensor], tol: Tolerance
) -> tuple[float, float, str | None, list[str]]:
    """(max abs diff, max rel diff, worst parameter by rel diff, parameters over tolerance in order)."""
    max_abs, max_rel, worst, over = 0.0, 0.0, None, []
    for name, r in ref.items():
        c = cand.get(name)
        if c is None or c.shape != r.shape:
            over.append(name)
            max_abs = max_rel = math.inf
            worst = name
            continue
        r64, c64 = r.to(torch.float64), c.to(torch.float64)
        diff = float((c64 - r64).abs().max()) if r.numel() else 0.0
        scale = float(r64.abs().max()) if r.numel() else 0.0
        if math.isnan(diff):
            diff = math.inf
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)
        if diff > tol.bound(scale):
            over.append(name)
        max_abs = max(max_abs, diff)
        if rel > max_rel or worst is None:
            max_rel, worst = max(rel, max_rel), name
    return max_abs, max_rel, worst, over


def compare(ref: RunData, cand: RunData, tol: Tolerances) -> Report:
    """Compare per step (loss, grad_norm, parameter digests) and the final parameters."""
    first: Divergence | None = None
    notes: list[str] = []
    steps = min(len(ref.records), len(cand.records))
    max_loss = max_gn = 0.0
    for i in range(steps):
        r, c = ref.records[i], cand.records[i]
        step = int(r["step"])
        loss_diff, loss_over = _scalar_gap(c["loss"], r["loss"], tol.steps)
        gn_diff, gn_over = _scalar_gap(c["grad_norm"], r["grad_norm"], tol.steps)
        max_loss, max_gn = max(max_loss, loss_diff), max(max_gn, gn_diff)
        if first is not None:
            continue
        gaps = (
            digest_gaps(ref.digests.get(step, {}), cand.digests.get(step, {}), tol.params)
            if step in ref.digests and step in cand.digests
            else []
        )
        furthest = gaps[0][1] if gaps and gaps[0][0] > 0 else None
        if loss_over:
            first = Divergence(step, "loss", furthest, r["loss"], c["loss"], loss_diff)
        elif gn_over:
            first = Divergence(step, "grad_norm", furthest, r["grad_norm"], c["grad_norm"], gn_diff)
        elif gaps and gaps[0][2]:
            first = Divergence(step, "parameter", gaps[0][1])

    max_abs = max_rel = math.nan
    worst: str | None = None
    complete = len(cand.records) >= len(ref.records) and cand.params is not None
    if ref.params is not None and cand.params is not None:
        max_abs, max_rel, worst, over = compare_params(ref.params, cand.params, tol.params)
        if over and first is None:
            first = Divergence(len(ref.records), "parameter", over[0])
    if cand.divergence is not None:  # the tripwire stopped the run: that is the first divergence
        d = cand.divergence
        first = Divergence(int(d["step"]), "ranks", str(d["parameter"]))
        notes.append(str(d["message"]))
    elif not complete and first is None:
        first = Divergence(len(cand.records) + 1, "missing", None)
    notes += [f"runtime warning at step {w.get('step')}: {w.get('message')}" for w in cand.warnings]
    if not complete:
        notes.append(
            f"candidate finished {len(cand.records)} of {len(ref.records)} steps"
            + ("" if cand.params is not None else " and wrote no final parameters")
        )
    if steps == 0:
        max_loss = max_gn = math.nan
    passed = complete and first is None and cand.divergence is None
    return Report(passed, steps, max_abs, max_rel, worst, max_loss, max_gn, first, notes)


def reproducible(first: RunData, second: RunData) -> bool:
    """True when two runs of the same configuration agree bit for bit (losses, norms, parameters)."""
    if [(r["loss"], r["grad_norm"]) for r in first.records] != [
        (r["loss"], r["grad_norm"]) for r in second.records
    ]:
        return False
    if first.params is None or second.params is None or first.params.keys() != second.params.keys():
        return False
    return all(torch.equal(first.params[k], second.params[k]) for k in first.params)
