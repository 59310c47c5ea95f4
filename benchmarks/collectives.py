"""Validate the α–β model of the collectives (``distaccum/tuning/collectives.py``) on this machine.

    python -m benchmarks.collectives [--rounds 8] [--smoke] [--out runs/collectives.json] [--update-docs]

One launch of 4 gloo ranks on loopback (CPU processes) times, interleaved over rounds so that drift of
a shared machine falls on every case alike:

- **calibration**: ring reduce-scatter and ring all-gather on 2 ranks at three sizes; α, β and γ of
  this machine's "link" are fitted to them (``fit_link``, least squares on the relative error);
- **validation**: ring all-reduce on 2 ranks (a collective the fit never saw), reduce-scatter and
  all-gather on 2 ranks at other sizes, and all three on 4 ranks, each predicted from the fitted link
  (4 processes on ``cores`` cores: ``cpu_shared``) and compared with its measured time.

All three are the ring algorithms of the formulas, written with gloo's send/recv and checked for the
right result before they are timed, so the algorithm is known: gloo's own ``reduce_scatter_tensor`` is
a clone plus an all-reduce (the profiler shows ``aten::clone`` and ``gloo:all_reduce`` under it), and
its all-gather and all-reduce are C++ implementations whose buffers and pipelining are their own. A case's time is the
median over rounds of a round's median call (a few calls back to back; the slowest rank's).
``--update-docs`` writes the validation rows into docs/planning.md between the ``collectives`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.launch import ROOT, launch
from distaccum.tuning.collectives import Link, Sample, fit_link, predict_ring

WORLD = 4
KIB, MIB = 1024, 1024 * 1024


@dataclass(frozen=True)
class Case:
    """One timed collective: ``op`` of ``n_bytes`` per rank on the first ``world`` ranks."""

    role: str
    """calibration (fitted) or validation (predicted)."""
    op: str
    world: int
    n_bytes: int


OPS = ("all_reduce", "reduce_scatter", "all_gather")


def cases(smoke: bool = False) -> list[Case]:
    """The calibration and validation cases (``smoke``: one size per world, for a plumbing check)."""
    fit_sizes = (64 * KIB, MIB, 8 * MIB)
    w2_sizes = (4 * MIB,) if smoke else (256 * KIB, 4 * MIB, 16 * MIB)
    w4_sizes = (4 * MIB,) if smoke else (MIB, 4 * MIB, 16 * MIB)
    found = [Case("calibration", op, 2, n) for n in fit_sizes for op in ("reduce_scatter", "all_gather")]
    found += [Case("validation", op, 2, n) for n in w2_sizes for op in OPS]
    return found + [Case("validation", op, 4, n) for n in w4_sizes for op in OPS]


def reps(n_bytes: int) -> int:
    """Calls per case and round: more for small messages, so a round's time is not one wake-up."""
    return max(3, min(40, 8 * MIB // n_bytes))


# -- the workers -------------------------------------------------------------------------------------


def ring(chunks: Any, tmp: Any, group: Any, first: int, reduce: bool) -> None:
    """Ring reduce-scatter (``reduce``) or all-gather in place on ``chunks`` (p rows of n/p): p-1 steps;
    at step s this rank sends chunk ``first - s`` to its right neighbour and receives chunk
    ``first - s - 1`` from its left (adding it to its own, for a reduce-scatter). A reduce-scatter
    from ``first = rank`` leaves the sum of chunk ``rank + 1`` here; an all-gather from ``first`` = the
    chunk this rank holds fills in all the others."""
    import torch.distributed as dist

    p, r = dist.get_world_size(group), dist.get_rank(group)
    right, left = dist.get_global_rank(group, (r + 1) % p), dist.get_global_rank(group, (r - 1) % p)
    for step in range(p - 1):
        into = (first - step - 1) % p
        pending = [
            dist.isend(chunks[(first - step) % p], right, group=group),
            dist.irecv(tmp if reduce else chunks[into], left, group=group),
        ]
        for request in pending:
            request.wait()
        if reduce:
            chunks[into].add_(tmp)


def run_case(op: str, chunks: Any, tmp: Any, group: Any) -> None:
    """One ring ``op`` on ``chunks``; the all-reduce is a reduce-scatter then an all-gather (2(p-1) steps)."""
    import torch.distributed as dist

    r = dist.get_rank(group)
    if op in ("reduce_scatter", "all_reduce"):
        ring(chunks, tmp, group, first=r, reduce=True)
    if op == "all_reduce":
        ring(chunks, tmp, group, first=(r + 1) % dist.get_world_size(group), reduce=False)
    if op == "all_gather":
        ring(chunks, tmp, group, first=r, reduce=False)


def check_rings(group: Any, world: int) -> None:
    """The rings compute what they claim (a timing of a wrong algorithm would validate nothing)."""
    import torch
    import torch.distributed as dist

    r = dist.get_rank(group)
    total = torch.arange(world * 4, dtype=torch.float64).view(world, 4) * world + 100 * sum(range(world))
    chunks = torch.arange(world * 4, dtype=torch.float64).view(world, 4) + 100 * r
    run_case("reduce_scatter", chunks, torch.empty(4, dtype=torch.float64), group)
    assert torch.equal(chunks[(r + 1) % world], total[(r + 1) % world]), (
        f"ring reduce-scatter wrong on rank {r}"
    )
    chunks = torch.arange(world * 4, dtype=torch.float64).view(world, 4) + 100 * r
    run_case("all_reduce", chunks, torch.empty(4, dtype=torch.float64), group)
    assert torch.equal(chunks, total), f"ring all-reduce wrong on rank {r}"
    mine = torch.full((world, 4), -1.0, dtype=torch.float64)
    mine[r] = total[r]
    run_case("all_gather", mine, torch.empty(4, dtype=torch.float64), group)
    assert torch.equal(mine, total), f"ring all-gather wrong on rank {r}"


def other_runnable(samples: int = 5) -> float:
    """Runnable threads of other programs right now: the median of a few readings of the kernel's count
    (``/proc/loadavg``), less this one (the caller runs while the other ranks are blocked)."""
    counts = []
    for _ in range(samples):
        time.sleep(0.002)
        counts.append(int(Path("/proc/loadavg").read_text().split()[3].split("/")[0]) - 1)
    return float(statistics.median(counts))


def worker(out: str, rounds: int, smoke: bool) -> None:
    """One rank: time every case ``rounds`` times, in an order rotated each round; rank 0 writes ``out``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {2: dist.new_group([0, 1]), WORLD: dist.group.WORLD}
    for world, group in groups.items():
        if rank < world:
            check_rings(group, world)
    todo = cases(smoke)
    buffers = {
        c: (torch.zeros(c.world, c.n_bytes // 4 // c.world), torch.empty(c.n_bytes // 4 // c.world))
        for c in todo
        if rank < c.world
    }  # allocated once: no page faults inside the timings
    times: dict[Case, list[float]] = {c: [] for c in todo}
    others: dict[Case, list[float]] = {c: [] for c in todo}
    for r in range(rounds):
        for i in range(len(todo)):
            case = todo[(i + r) % len(todo)]
            dist.barrier()
            if rank == 0:  # the other ranks wait in the barrier below: not runnable
                others[case].append(other_runnable())
            dist.barrier()
            if rank >= case.world:
                continue
            group = groups[case.world]
            run_case(case.op, *buffers[case], group)  # warm: connections, caches
            dist.barrier(group=group)
            calls = []
            for _ in range(reps(case.n_bytes)):
                start = time.perf_counter()
                run_case(case.op, *buffers[case], group)
                calls.append(time.perf_counter() - start)
            # The median call of the block (a call descheduled by another process does not move it), of
            # the slowest rank.
            took = torch.tensor([statistics.median(calls)], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
            times[case].append(took.item())
    if rank == 0:
        Path(out).write_text(
            json.dumps([{**asdict(c), "times": times[c], "others": others[c]} for c in todo])
        )
    dist.destroy_process_group()


# -- the parent --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One case, measured and (validation) predicted."""

    case: Case
    measured_s: float
    predicted_s: float
    others: float
    """Runnable processes of other programs when it was timed (median over rounds)."""

    @property
    def error(self) -> float:
        """Predicted / measured - 1."""
        return self.predicted_s / self.measured_s - 1


def cores() -> int:
    """CPU cores this process may run on (the ranks share them)."""
    return len(os.sched_getaffinity(0))


def evaluate(measured: Sequence[dict[str, Any]], n_cores: int) -> tuple[Link, list[Row]]:
    """Fit the link to the calibration cases' medians and predict every case."""
    found = []
    for m in measured:
        case = Case(**{k: m[k] for k in ("role", "op", "world", "n_bytes")})
        found.append((case, statistics.median(m["times"]), statistics.median(m["others"])))
    link = fit_link(
        [Sample(c.op, c.world, c.n_bytes, t) for c, t, _ in found if c.role == "calibration"], n_cores
    )
    return link, [Row(c, t, predict_ring(c.op, c.n_bytes, c.world, link, n_cores), o) for c, t, o in found]


def busy(rows: Sequence[Row]) -> float:
    """The median count of other programs' runnable processes over the cases: above ``QUIET`` the
    machine was shared, and the ranks' share of the cores (``cpu_shared``) was not what the model says."""
    return statistics.median(r.others for r in rows)


QUIET = 0.5
"""The most other runnable processes (median over the cases) a run may see and still count as quiet."""


def measure(
    rounds: int, smoke: bool, scratch: Path, timeout_s: float = 600
) -> tuple[list[dict[str, Any]], Any]:
    """Launch the 4 ranks; their raw times and the launch record."""
    out = scratch / "collectives_raw.json"
    done = launch(
        "benchmarks.collectives",
        ["--worker", str(out), "--rounds", str(rounds)] + (["--smoke"] if smoke else []),
        WORLD,
        scratch / "collectives.log",
        timeout_s,
    )
    if not done.ok:
        raise RuntimeError(f"the measuring ranks failed: {done.tail}")
    return json.loads(out.read_text()), done


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"


def table(link: Link, rows: Sequence[Row], note: str) -> str:
    """The validation rows as markdown, with the fitted link and how it was measured."""
    lines = [
        f"Fitted on this machine (ring reduce-scatter and all-gather, 2 ranks, 64 KiB–8 MiB): "
        f"α = {link.alpha_s * 1e6:.0f} µs, β = {link.beta_bytes_per_s / 1e9:.2f} GB/s, "
        f"γ = {link.gamma_s_per_byte * 1e9:.3f} ns/byte. {note}",
        "",
        "| collective | size per rank | world | other runnable | predicted | measured | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.case.role == "validation":
            lines.append(
                f"| ring {r.case.op.replace('_', '-')} | {_size(r.case.n_bytes)} | {r.case.world} | "
                f"{r.others:g} | {r.predicted_s * 1e3:.2f} ms | {r.measured_s * 1e3:.2f} ms | {r.error:+.1%} |"
            )
    return "\n".join(lines)


BEGIN = "<!-- collectives:begin (generated by python -m benchmarks.collectives --update-docs; edits here are lost) -->"
END = "<!-- collectives:end -->"


def replace_section(text: str, body: str) -> str:
    """``text`` with the content between the collectives markers replaced by ``body``."""
    start, stop = text.find(BEGIN), text.find(END)
    if start < 0 or stop < start:
        raise ValueError(f"no '{BEGIN}' ... '{END}' section")
    return text[: start + len(BEGIN)] + "\n\n" + body.strip() + "\n\n" + text[stop:]


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, fit, predict, print; 0 when every validation row is within 25 % on a quiet machine, 1 when
    one is not, 2 when the machine was shared (nothing judged; docs/planning.md is not updated)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument(
        "--smoke", action="store_true", help="one size per world: checks the plumbing, not the model"
    )
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "collectives.json")
    p.add_argument(
        "--update-docs",
        action="store_true",
        help="write the table into docs/planning.md (refused when the machine was shared, unless --smoke)",
    )
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rounds, args.smoke)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    measured, done = measure(args.rounds, args.smoke, args.out.parent)
    n_cores = cores()
    link, rows = evaluate(measured, n_cores)
    shared = busy(rows) > QUIET
    note = (
        f"{'Smoke run (provisional figures). ' if args.smoke else ''}{args.rounds} rounds, {n_cores} cores, "
        f"other programs' runnable processes {busy(rows):g} (median; the model assumes none), 1-minute load "
        f"average {done.load_1m[0]:.1f} before and {done.load_1m[1]:.1f} after (the 4 ranks alone add about 2)."
    )
    text = table(link, rows, note)
    print(text)
    args.out.write_text(
        json.dumps(
            {
                "link": asdict(link),
                "cores": n_cores,
                "rounds": args.rounds,
                "smoke": args.smoke,
                "load_1m": done.load_1m,
                "rows": [
                    {
                        **asdict(r.case),
                        "measured_s": r.measured_s,
                        "predicted_s": r.predicted_s,
                        "others": r.others,
                    }
                    for r in rows
                ],
            },
            indent=1,
        )
        + "\n"
    )
    if shared:
        print(
            f"the machine was shared ({busy(rows):g} other runnable processes on median, more than {QUIET}): the "
            "4 ranks did not have the cores the model gives them; nothing judged, run it on a quiet machine"
        )
    if args.update_docs and (args.smoke or not shared):
        doc = ROOT / "docs" / "planning.md"
        doc.write_text(replace_section(doc.read_text(encoding="utf-8"), text), encoding="utf-8")
        print(f"wrote the table into {doc}")
    if shared:
        return 2
    worst = max(abs(r.error) for r in rows if r.case.role == "validation")
    return 0 if worst <= 0.25 else 1


if __name__ == "__main__":
    sys.exit(main())
