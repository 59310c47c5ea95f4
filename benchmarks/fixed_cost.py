"""distaccum's fixed cost per optimizer step, in CPU time: ``python -m benchmarks.fixed_cost``.

The timing harness compares step times, whose spread on a shared 2-core machine (a few percent per round) is
as large as what is left to find at K = 1. This tool measures the fixed cost directly: on a model so small
(the smoke case's 1.7k-parameter MLP, micro-batch 2) that a step is almost nothing but the loop's own work,
each variant runs ``--steps`` optimizer steps in a row, and every rank reads the CPU time its process used
(``getrusage``: every thread, the process group's workers included), the wall time, the voluntary
context switches (a thread waiting: mostly the collectives' hand-offs) and the minor page faults (memory touched for
the first time since the allocator took it from the system). Variants alternate in a balanced order
(:func:`benchmarks.interleave.round_order`) over ``--rounds`` rounds; the table gives medians over rounds of the
slower rank. CPU time is what a bigger step pays for the same work whenever the ranks keep the cores busy (2
ranks on 2 cores, as here), so its difference between two variants prices what one does and the other does
not, far more steadily than a ratio of step times:

- ``ddp_window_allgather`` - ``ddp_python_hook``: the window's second, small collective (an all-gather of each
  rank's row, as :class:`~distaccum.window.HostTotals` sends it), and ``ddp_window_allreduce`` - ``ddp_python_hook``
  the all-reduce it replaced;
- ``distaccum`` - ``ddp_window_allgather``: the rest of distaccum's per-step work (the loop, the ledger, the
  fingerprint, the data plan, the record and its sinks);
- ``distaccum`` - ``distaccum_no_ledger`` / ``distaccum_no_fingerprint``: those two switches;
- ``distaccum_loader`` - ``distaccum`` (name it with ``--variants``): what cutting an in-memory ``TensorDataset`` in
  the process (:class:`~distaccum.data.pipeline.TensorRows`) saves against a DataLoader per micro-batch;
- ``distaccum_host_allreduce`` - ``distaccum`` (name it with ``--variants``): what the window's all-gather on the CPU
  saves against the all-reduce it replaced;
- ``distaccum_device_totals`` - ``distaccum``: what the window's totals as Python floats (the CPU's
  :class:`~distaccum.window.HostTotals`) save against one-number tensors (an accelerator's ``DeviceTotals``).

With ``--sections`` it says where distaccum's own part goes instead: distaccum runs with a timer around each
per-step piece of the loop (:data:`PIECES`: the window's totals, the fingerprint, the engine's step, the timer,
the sinks, ...), printing each piece's wall and CPU time per step (the CPU time of the thread that ran it: the
normalization runs in the process group's worker, when the bucket's all-reduce lands) and the sums by group.
The thread's CPU time leaves out the other threads' and the scheduler's noise that the process's includes, so
with ``--variants`` naming several distaccum variants (blocks in the balanced order, like the default mode) it
prices a change to distaccum's own pieces that the default mode's spread hides.

``--case`` runs a timing case's model instead (``27.3M_micro4``: a variant's CPU time per step where its step time is
too noisy to show a difference of a percent or two; fewer ``--steps``, the steps are long).

    python -m benchmarks.fixed_cost --steps 2000 --rounds 3
    python -m benchmarks.fixed_cost --case 27.3M_micro4 --k 4 --steps 8 --rounds 6 --variants ddp_no_sync,ddp_python_hook_after,distaccum
    python -m benchmarks.fixed_cost --sections --steps 3000
    python -m benchmarks.fixed_cost --sections --variants distaccum,distaccum_device_totals --steps 1000 --rounds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.cases import FULL_CASES, SMOKE_CASES, BenchData, Spec, launch_spec
from benchmarks.device import join, worker_main
from benchmarks.interleave import round_order, timed_block
from benchmarks.launch import launch
from benchmarks.stats import Spread, spread
from benchmarks.variants import build_variant, check_variants

VARIANTS = ("ddp_no_sync", "ddp_python_hook", "ddp_window_allreduce", "ddp_window_allgather", "distaccum",
            "distaccum_device_totals",
            "distaccum_no_ledger", "distaccum_no_fingerprint")
SECTION_VARIANTS = ("distaccum",)
"""What ``--sections`` times by default (it times distaccum's own pieces: name distaccum variants only)."""
BASELINE = "ddp_python_hook"
"""What the differences are taken against: distaccum's reduction runs in a Python comm hook too."""


WINDOW = "window totals, their collective, scale and normalization"
FINGERPRINT = "reduction fingerprint"
ENGINE = "engine step around the optimizer"
DATA = "data plan and the move to the device"
RECORD = "record: step timer, straggler view, sinks, record"
OPTIMIZER = "the optimizer's step and zero_grad (the hand-written loops' too)"
PIECES: tuple[tuple[str, str | None, tuple[str, ...], str], ...] = (
    ("distaccum.window", "HostTotals", ("__init__", "add", "reduce", "grad_scale", "read"), WINDOW),  # on the CPU
    ("distaccum.window", "DeviceTotals", ("__init__", "add", "reduce", "grad_scale", "read"), WINDOW),
    ("distaccum.window", "WindowTotals", ("carry",), WINDOW),
    ("distaccum.loop", None, ("power_of_two_scale", "micro_factor"), WINDOW),
    ("distaccum.engines.replicated", None, ("normalize_",), WINDOW),
    ("distaccum.verify.fingerprint", "Fingerprint", ("before_reduce", "after_reduction", "judge"), FINGERPRINT),
    ("distaccum.engines.replicated", "ReplicatedEngine", ("step",), ENGINE),
    ("distaccum.data.pipeline", "PlanSource", ("window", "advance"), DATA),
    ("distaccum.loop", None, ("to_device",), DATA),
    ("distaccum.telemetry.timing", "StepTimer", ("start_step", "start_micro", "batch_ready", "compute_done",
                                                 "finish_step"), RECORD),
    ("distaccum.telemetry.timing", "PendingTimes", ("resolve",), RECORD),
    ("distaccum.telemetry.timing", "RankStats", ("fields",), RECORD),
    ("distaccum.telemetry.sinks", "MultiSink", ("log",), RECORD),
    ("distaccum.loop", None, ("step_record",), RECORD),
    ("distaccum.trainer", "Trainer", ("_after_step",), RECORD),
    ("torch.optim", "SGD", ("step",), OPTIMIZER),  # the benchmark's optimizer
    ("torch.optim", "Optimizer", ("zero_grad",), OPTIMIZER),
)
"""(module, class or None, functions, group): the per-step pieces of distaccum's loop that ``--sections`` times,
and the group of its own work each belongs to."""
INSIDE = {"WindowTotals.carry": "Fingerprint.before_reduce", "HostTotals.grad_scale": "replicated.normalize_",
          "DeviceTotals.grad_scale": "replicated.normalize_",
          "SGD.step": "ReplicatedEngine.step", "Optimizer.zero_grad": "ReplicatedEngine.step"}
"""Pieces that run inside another timed piece (``grad_scale``: its first call of a step, which does the work; the
second returns the cached scale). The group sums leave them out, and take the optimizer's two out of the engine
step: the hand-written loops make those too."""


def label_of(module_name: str, owner_name: str | None, name: str) -> str:
    """A piece's label: ``Class.function``, or ``module.function`` for a module's function."""
    return f"{owner_name or module_name.rsplit('.', 1)[-1]}.{name}"


def own_groups(pieces: dict[str, list[float]]) -> dict[str, float]:
    """CPU us per step of distaccum's own work by group: every piece not inside another, the engine step less the
    optimizer's step and ``zero_grad``."""
    group_of = {label_of(module, owner, name): group for module, owner, names, group in PIECES for name in names}
    groups: dict[str, float] = {}
    for label, (_, cpu, _) in pieces.items():
        if label in INSIDE:
            continue
        inner = [pieces[i][1] for i, outer in INSIDE.items() if outer == label and group_of[i] == OPTIMIZER]
        groups[group_of[label]] = groups.get(group_of[label], 0.0) + cpu - sum(inner)
    return groups


def time_pieces(pieces: tuple[tuple[str, str | None, tuple[str, ...], str], ...] = PIECES) -> dict[str, list[int]]:
    """Wrap every piece with a timer (this process only); returns piece -> [wall ns, CPU ns, calls], filled as
    they run. CPU time is the calling thread's (``time.thread_time_ns``)."""
    totals: dict[str, list[int]] = {}
    for module_name, owner_name, names, _ in pieces:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        for name in names:
            label = label_of(module_name, owner_name, name)
            totals[label] = [0, 0, 0]
            setattr(owner, name, _timed(getattr(owner, name), totals[label]))
    return totals


def _timed(function: Callable[..., Any], total: list[int]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return function(*args, **kwargs)
        finally:
            total[0] += time.perf_counter_ns() - wall
            total[1] += time.thread_time_ns() - cpu
            total[2] += 1

    return timed


def measure_sections(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Each of ``spec.variants`` (distaccum's kinds) with :func:`time_pieces` installed, in blocks of ``spec.steps``
    steps over ``spec.rounds`` rounds in the balanced order after a warm-up: per variant and piece, rank 0's wall
    us, CPU us and calls per step."""
    totals = time_pieces()
    device, clock = join(spec.device)
    data = BenchData(spec, dist.get_world_size())
    variants = {name: build_variant(name, spec, data, dist.get_rank(), device, clock, workdir / name)
                for name in spec.variants}
    for variant in variants.values():
        timed_block(variant, spec.warmup, clock)
    sums = {name: {label: [0, 0, 0] for label in totals} for name in variants}
    for r in range(spec.rounds):
        for name in round_order(spec.variants, r):
            dist.barrier()
            before = {label: list(total) for label, total in totals.items()}
            variants[name].run(spec.steps)
            for label, total in totals.items():
                sums[name][label] = [s + now - then for s, now, then in zip(sums[name][label], total, before[label],
                                                                            strict=True)]
    steps = spec.steps * spec.rounds
    for variant in variants.values():
        variant.close()
    return {"spec": json.loads(spec.to_json()),
            "pieces": {name: {label: [wall / steps / 1e3, cpu / steps / 1e3, calls / steps]
                              for label, (wall, cpu, calls) in pieces.items()} for name, pieces in sums.items()}}


def report_sections(record: dict[str, Any]) -> str:
    """The first variant's pieces by CPU time per step, largest first; every variant's group sums."""
    spec, pieces = record["spec"], record["pieces"]
    first = next(iter(pieces))
    lines = [f"{', '.join(pieces)}: {spec['steps']} steps per block, {spec['rounds']} rounds, "
             f"{parameter_tensors(spec)} parameter tensors, K = {spec['accum_steps']}; rank 0, per optimizer step", "",
             f"{first}:", "", "| piece | wall us | CPU us | calls |", "|---|---:|---:|---:|"]
    rows = sorted(pieces[first].items(), key=lambda item: -item[1][1])
    lines += [f"| {label} | {wall:.1f} | {cpu:.1f} | {calls:.2f} |" for label, (wall, cpu, calls) in rows if calls]
    groups = {name: own_groups(variant) for name, variant in pieces.items()}
    totals = {name: sum(g.values()) for name, g in groups.items()}
    order = sorted(groups[first], key=lambda g: -groups[first][g])
    lines += ["", "distaccum's own work by group, CPU us per step (pieces inside another left out; the engine step less "
              "the optimizer's step and zero_grad; the share is the first column's):", "",
              f"| group | {' | '.join(pieces)} | share |", "|---|" + "---:|" * (len(pieces) + 1)]
    lines += [f"| {group} | {' | '.join(f'{g.get(group, 0.0):.1f}' for g in groups.values())} | "
              f"{groups[first][group] / totals[first]:.0%} |" for group in order]
    lines.append(f"| all of distaccum's own pieces | {' | '.join(f'{t:.1f}' for t in totals.values())} | 100% |")
    return "\n".join(lines)


def usage() -> tuple[float, float, int, int]:
    """(CPU seconds of this process, every thread; wall seconds; voluntary context switches; minor page faults)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, time.perf_counter(), r.ru_nvcsw, r.ru_minflt


def measure(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Warm every variant up, then run blocks of ``spec.steps`` steps in a balanced order; per block and rank:
    CPU ms, wall ms, voluntary switches and minor page faults per step (rank 0's record holds every rank's)."""
    device, clock = join(spec.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = BenchData(spec, world)
    variants = {name: build_variant(name, spec, data, rank, device, clock, workdir) for name in spec.variants}
    for variant in variants.values():
        timed_block(variant, spec.warmup, clock)
    blocks: dict[str, list[list[list[float]]]] = {name: [] for name in variants}
    for r in range(spec.rounds):
        for name in round_order(spec.variants, r):
            dist.barrier()
            cpu0, wall0, switches0, faults0 = usage()
            variants[name].run(spec.steps)
            cpu1, wall1, switches1, faults1 = usage()
            mine = [(cpu1 - cpu0) / spec.steps * 1e3, (wall1 - wall0) / spec.steps * 1e3,
                    (switches1 - switches0) / spec.steps, (faults1 - faults0) / spec.steps]
            every: list[list[float] | None] = [None] * world
            dist.all_gather_object(every, mine)
            blocks[name].append(every)  # type: ignore[arg-type]
    for variant in variants.values():
        variant.close()
    return {"spec": json.loads(spec.to_json()), "world_size": world, "blocks": blocks}


FIELDS = ("cpu_ms", "wall_ms", "switches", "faults")


def slower_rank(record: dict[str, Any]) -> dict[str, list[list[float]]]:
    """Per variant and round: the largest CPU ms, wall ms, switches and page faults per step over the ranks."""
    return {name: [[max(rank[i] for rank in ranks) for i in range(len(FIELDS))] for ranks in rounds]
            for name, rounds in record["blocks"].items()}


def summarize(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per variant: medians over rounds of the slower rank's CPU ms, wall ms, switches and page faults per step."""
    return {name: {key: statistics.median(row[i] for row in rows) for i, key in enumerate(FIELDS)}
            for name, rows in slower_rank(record).items()}


def difference(record: dict[str, Any], a: str, b: str, field: str = "cpu_ms") -> Spread:
    """``a`` - ``b`` per round (both ran in every round), spread over rounds."""
    rows, i = slower_rank(record), FIELDS.index(field)
    return spread([x[i] - y[i] for x, y in zip(rows[a], rows[b], strict=True)])


def parameter_tensors(spec: dict[str, Any]) -> int:
    """The MLP's weight and bias tensors: one Linear per hidden layer, plus the output layer."""
    return 2 * (spec["shape"]["depth"] + 1)


def report(record: dict[str, Any]) -> str:
    """The per-variant table and the differences that price each part of the fixed cost."""
    spec, rows = record["spec"], summarize(record)
    lines = [f"{spec['steps']} steps per block, {spec['rounds']} rounds, world {record['world_size']}, "
             f"{spec['case']} model with {parameter_tensors(spec)} parameter tensors, micro-batch {spec['micro_batch']}, "
             f"K = {spec['accum_steps']}; "
             "medians over rounds of the slower rank", "",
             "| variant | CPU ms / step | wall ms / step | voluntary switches / step | minor page faults / step |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {r['cpu_ms']:.2f} | {r['wall_ms']:.2f} | {r['switches']:.1f} | {r['faults']:.1f} |"
              for name, r in rows.items()]
    pairs = [("ddp_window_allgather", BASELINE, "the window's second, small collective (an all-gather of each rank's row)"),
             ("ddp_window_allreduce", BASELINE, "the same as an all-reduce (distaccum's window before this release)"),
             ("distaccum", "ddp_window_allgather", "distaccum's per-step Python: loop, ledger, fingerprint, data, record"),
             ("distaccum", BASELINE, "distaccum's whole fixed cost"),
             ("distaccum", "ddp_no_sync", "the same against the expert loop (DDP's C++ all-reduce)"),
             ("distaccum_host_allreduce", "distaccum_gloo_window", "what the window's all-gather saves against an "
              "all-reduce, both on gloo (HostTotals)"),
             ("distaccum_device_totals", "distaccum", "what the CPU's window totals save (HostTotals: Python floats, "
              "one exchange; DeviceTotals all-reduces one-number tensors on gloo)"),
             ("distaccum_loader", "distaccum", "the DataLoader against the in-process rows (TensorRows)"),
             ("distaccum_gloo_window", "distaccum", "the window's rows through gloo's all-gather against the run's "
              "Unix sockets (distaccum.cluster.exchange)"),
             ("distaccum", "distaccum_no_ledger", "the ledger (log.ledger)"),
             ("distaccum", "distaccum_no_fingerprint", "the reduction fingerprint (trainer.fingerprint)"),
             ("distaccum", "distaccum_no_checks", "every per-step check a switch turns off (fingerprint, ledger, "
              "straggler view)"),
             ("distaccum_no_checks", "ddp_no_sync", "distaccum with those checks off against the expert loop")]
    known = [(a, b, what) for a, b, what in pairs if a in rows and b in rows]
    if known:
        lines += ["", "Differences per round (median, min to max over rounds):", "",
                  "| difference | CPU ms / step | wall ms / step | what it prices |", "|---|---:|---:|---|"]
        for a, b, what in known:
            cells = [f"{d.median:+.2f} ({d.min:+.2f} to {d.max:+.2f})"
                     for d in (difference(record, a, b, field) for field in ("cpu_ms", "wall_ms"))]
            lines.append(f"| {a} - {b} | {cells[0]} | {cells[1]} | {what} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps per variant per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--depth", type=int, default=None,
                        help=f"the MLP's hidden layers (default the case's, {SMOKE_CASES[0].shape.depth} for the smoke "
                             "case; 2 parameter tensors each): more tensors price what is done per parameter")
    cases = {c.name: c for c in SMOKE_CASES + FULL_CASES}
    parser.add_argument("--case", default=SMOKE_CASES[0].name, choices=list(cases),
                        help="the model and micro-batch (default %(default)s, where a step is almost nothing but the "
                             "loop's own work; a timing case such as 27.3M_micro4 prices, in CPU time, what a variant "
                             "does per step on a model whose step time is too noisy to show it)")
    parser.add_argument("--variants", default=None,
                        help=f"default {','.join(VARIANTS)}; with --sections {','.join(SECTION_VARIANTS)}")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: 2 ranks on gloo; cuda: one rank per GPU on NCCL (the host's work per step when the "
                             "device waits for it: the window's totals are DeviceTotals there)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="as benchmarks.run's")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw record here")
    parser.add_argument("--sections", action="store_true",
                        help="distaccum (or the distaccum --variants named) with each per-step piece of its loop "
                             "timed (PIECES)")
    args = parser.parse_args(argv)
    variants = tuple(args.variants.split(",")) if args.variants else SECTION_VARIANTS if args.sections else VARIANTS
    check_variants(list(variants))
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available here")
    spec = launch_spec(cases[args.case], args.k, rounds=args.rounds, variants=variants, device=args.device,
                       precision=args.precision)
    depth = spec.shape.depth if args.depth is None else args.depth
    spec = dataclasses.replace(spec, steps=args.steps, warmup=5, shape=dataclasses.replace(spec.shape, depth=depth))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "fixed_cost.json"
        mode = "--worker-sections" if args.sections else "--worker"
        world = torch.cuda.device_count() if args.device == "cuda" else 2
        result = launch("benchmarks.fixed_cost", [mode, spec.to_json(), str(out), tmp], world,
                        Path(tmp) / "log", timeout_s=1800)
        if not result.ok:
            sys.exit(f"the fixed-cost launch failed: {result.tail}")
        record = json.loads(out.read_text())
    if args.json is not None:
        args.json.write_text(json.dumps(record, indent=1))
    print(f"Command: python -m benchmarks.fixed_cost {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(report_sections(record) if args.sections else report(record))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("--worker", "--worker-sections"):
        worker_main("benchmarks.fixed_cost", measure if sys.argv[1] == "--worker" else measure_sections,
                    Spec.from_json, sys.argv[2:])
    else:
        main()
