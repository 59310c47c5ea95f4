"""Benchmark distaccum's loop against the expert hand-written loop: timing, memory in K, operators per step.

``python -m benchmarks.run [--smoke] [--out DIR] ...`` (``make bench``; ``make bench-smoke`` at the CI size):

1. **timing** (:mod:`benchmarks.workers`): per case and K, one world of processes holds every variant and alternates
   them block by block in a balanced order, for whole cycles of rounds until ``--budget-s`` seconds have passed
   (or ``--rounds`` rounds); the tables give the medians of per-round ratios with their 95 % intervals.
2. **memory**: per case, K in the case's ``sweep_ks`` and engine variant, fresh processes: peak memory (flat in K?)
   and distaccum's per-step communication records.
3. **host operators** (:mod:`benchmarks.host_ops`): the operators one step issues, distaccum against the expert
   loop, counted at K = 1 and 16 (CPU).

Writes ``results.json`` (the code and environment, every round of every launch; rewritten after each launch, so a
run stopped part-way keeps what it finished) and ``results.md`` (its tables, rendered as BENCHMARKS.md renders them)
into ``--out``; exits 1 if any launch failed. ``python -m benchmarks.report --store OUT/results.json`` (``make
bench-docs``) keeps it in docs/results/ and renders BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import host_ops
from benchmarks.cases import FULL_CASES, GPU_CASES, SMOKE_CASES, Case, launch_spec
from benchmarks.launch import ROOT, Launch, launch, provenance
from benchmarks.report import render_results
from benchmarks.stats import spread, summarize_launch
from benchmarks.variants import SWEPT, TIMED, check_variants, sync_of

HSDP_SWEEP = (
    "distaccum_fsdp",
    "distaccum_hsdp_boundary",
    "distaccum_hsdp_replica_boundary",
    "distaccum_hsdp_every_micro",
)
"""FSDP2 flat and hybrid (2 replicas) in each sync mode: ``--sweep hsdp --world 4`` (2 replicas x 2 shards)."""
SMOKE_SWEEP = ("ddp_no_sync", "distaccum", "distaccum_fsdp", "distaccum_zero2")
"""The CI sweep: one of each kind of engine (DeepSpeed's first use in a checkout compiles an op, once)."""
SMOKE_TIMED = ("ddp_no_sync", "distaccum", "compute_floor", "ddp_no_sync_twin")
"""The CI timing: the table's eager columns and the A/A control (compiling is left to ``make bench``)."""
SWEEP_CPU_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""The memory launches' workers on CPU: glibc's mmap threshold fixed at its default 128 KiB. Left dynamic, glibc
raises it to the size of the largest block freed so far, after which blocks of that size come from the heap and
stay resident when freed; peak RSS then grows with the number of allocations (K micro-batches) instead of what is
alive at once. Fixed, every tensor of 128 KiB or more is its own mapping, returned on free, and peak RSS follows
the live tensors, as the CUDA allocator's peak does on GPU. The same for every variant, hand-written ones included."""
BUDGET_S = 120.0
"""Seconds of rounds per timing launch by default: six launches of two cases fit ``make bench`` in about half an
hour on 2 cores with the memory sweep and the operator counts."""


def _launch_info(result: Launch) -> dict[str, Any]:
    return {
        "ok": result.ok,
        "wall_s": round(result.wall_s, 2),
        "rank_max_rss_mb": round(result.peak_rss_mb, 1),
        "load_1m": [round(x, 2) for x in result.load_1m],
        "error": result.tail,
    }


def run_timing(
    cases: Sequence[Case],
    variants: tuple[str, ...],
    *,
    rounds: int,
    steps: int,
    budget_s: float,
    device: str,
    precision: str,
    world: int,
    scratch: Path,
    timeout: float,
    done: Callable[[list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """One interleaved launch per case and K; ``done(rows so far)`` after each launch."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        for k in case.ks:
            spec = launch_spec(
                case,
                k,
                steps=steps,
                rounds=rounds,
                budget_s=budget_s,
                variants=variants,
                device=device,
                precision=precision,
            )
            out, work = scratch / f"timing-{case.name}-k{k}.json", scratch / f"timing-{case.name}-k{k}"
            argv = ["timing", spec.to_json(), str(out), str(work)]
            result = launch("benchmarks.workers", argv, world, work / "output.log", timeout)
            if out.exists():  # rank 0 wrote it after every rank finished measuring
                row = summarize_launch(json.loads(out.read_text()))
            else:
                row = {
                    "case": case.name,
                    "k": k,
                    "rounds": 0,
                    "variants": {},
                    "ratios": {},
                    "param_rel_diff": {},
                }
            row.update({"status": "ok" if out.exists() else "failed", "launch": _launch_info(result)})
            rows.append(row)
            ratio = row["ratios"].get("distaccum / expert")
            print(
                f"[timing] {case.name} K={k}: {row['status']}, {row['rounds']} rounds, {result.wall_s:.0f} s, load "
                f"{result.load_1m[1]:.2f}" + (f", distaccum / expert {ratio['median']:.3f}" if ratio else ""),
                flush=True,
            )
            if not result.ok:
                print(result.tail, file=sys.stderr, flush=True)
            done(rows)
    return rows


def run_memory(
    cases: Sequence[Case],
    variants: tuple[str, ...],
    *,
    device: str,
    precision: str,
    world: int,
    scratch: Path,
    timeout: float,
    env: dict[str, str],
    done: Callable[[list[dict[str, Any]]], None],
) -> list[dict[str, Any]]:
    """One fresh launch per case, K and variant: 2 warm-up and 3 timed steps; ``done(rows so far)`` after each."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        for k in case.sweep_ks:
            for variant in variants:
                spec = launch_spec(case, k, steps=3, variants=(variant,), device=device, precision=precision)
                name = f"memory-{case.name}-k{k}-{variant}"
                out, work = scratch / f"{name}.json", scratch / name
                argv = ["memory", spec.to_json(), str(out), str(work)]
                result = launch("benchmarks.workers", argv, world, work / "output.log", timeout, env=env)
                row: dict[str, Any] = {
                    "case": case.name,
                    "k": k,
                    "variant": variant,
                    "sync": sync_of(variant),
                    "status": "ok" if out.exists() else "failed",
                    "launch": _launch_info(result),
                }
                if out.exists():
                    rec = json.loads(out.read_text())
                    row.update(
                        {
                            "step_s": spread(rec["step_s"]).as_dict(),
                            "records": rec["records"],
                            **{
                                key.replace("_bytes", "_mb"): rec[key] / 2**20
                                for key in ("setup_peak_bytes", "step_peak_bytes", "process_peak_bytes")
                            },
                        }
                    )
                rows.append(row)
                print(
                    f"[memory] {case.name} K={k} {variant}: {row['status']}, {result.wall_s:.0f} s"
                    + (f", step peak {row['step_peak_mb']:.0f} MiB" if out.exists() else ""),
                    flush=True,
                )
                if not result.ok:
                    print(result.tail, file=sys.stderr, flush=True)
                done(rows)
    return rows


def run_ops(ks: Sequence[int], scratch: Path) -> tuple[dict[str, Any], list[str]]:
    """The operator counts at each K (:func:`benchmarks.host_ops.measure`), and the Ks whose launch failed."""
    counts, failed = {}, []
    for k in ks:
        try:
            counts[str(k)] = host_ops.measure(k, scratch)
        except RuntimeError as err:
            failed.append(f"host ops K={k}")
            print(err, file=sys.stderr, flush=True)
            continue
        got = counts[str(k)]
        print(
            f"[host ops] K={k}: expert {got['expert']['ops']}, distaccum {got['distaccum']['ops']}",
            flush=True,
        )
    return counts, failed


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="tiny model, K = 1, 2, 2 rounds, a small sweep: the CI run"
    )
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench", help="results directory")
    p.add_argument(
        "--cases",
        default=None,
        help="comma-separated case names (default: the size's; on a GPU, 210M_micro1024 too)",
    )
    p.add_argument("--ks", default=None, help="comma-separated K values for the timing (default: the case's)")
    p.add_argument("--variants", default=None, help=f"timing variants (default {','.join(TIMED)})")
    p.add_argument(
        "--sweep",
        default=None,
        help=f"memory variants (default {','.join(SWEPT)}; 'none' skips the "
        "memory launches; 'hsdp': FSDP2 flat and hybrid in each sync mode, with --world 4)",
    )
    p.add_argument("--no-timing", action="store_true", help="no timing launches")
    p.add_argument(
        "--ops",
        default=None,
        help="K values of the operator counts (default 1,16; smoke 1,2; 'none' skips them; CPU only)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help=f"seconds of rounds per timing launch: whole cycles "
        f"of rounds until the time is spent (default {BUDGET_S:g} unless --rounds is given; smoke none)",
    )
    p.add_argument(
        "--rounds", type=int, default=None, help="rounds per timing launch (with a budget: the most)"
    )
    p.add_argument(
        "--block-steps",
        type=int,
        default=None,
        help="optimizer steps per variant per round (default 1: "
        "the variants alternate step by step, the most rounds for the machine time; smoke 2)",
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="cuda when present (auto)"
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="what every variant computes in: "
        "fp32, or bf16 autocast (the hand-written loops' forward and distaccum's precision=bf16)",
    )
    p.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, every GPU on CUDA)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launch")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; write results.json and results.md; 1 if any launch failed, 2 for bad options.

    SIGTERM (a ``timeout``, a batch system, a lease that ends) becomes SystemExit: the launch in progress kills its
    ranks on the way out (:func:`benchmarks.launch.launch`), and results.json keeps the launches already finished."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The run's resolved options; ValueError for bad ones (before any launch)."""
    import torch

    device = (
        "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda, but CUDA is not available here")
    variants = tuple(
        v for v in (args.variants or ",".join(SMOKE_TIMED if args.smoke else TIMED)).split(",") if v
    )
    named = {"none": (), "hsdp": HSDP_SWEEP}
    sweep = args.sweep or ",".join(SMOKE_SWEEP if args.smoke else SWEPT)
    sweep_names = named.get(sweep, tuple(v for v in sweep.split(",") if v))
    check_variants(list(variants))
    for name in sweep_names:
        check_variants([name])
    known = SMOKE_CASES if args.smoke else FULL_CASES + GPU_CASES
    cases = SMOKE_CASES if args.smoke else FULL_CASES + (GPU_CASES if device == "cuda" else ())
    if args.cases:
        wanted = args.cases.split(",")
        unknown = [name for name in wanted if name not in {c.name for c in known}]
        if unknown:
            raise ValueError(
                f"--cases {args.cases}: no case {', '.join(unknown)}; choose from "
                f"{', '.join(c.name for c in known)}"
            )
        cases = tuple(c for c in known if c.name in wanted)
    if args.ks:
        cases = tuple(dataclasses.replace(c, ks=tuple(int(k) for k in args.ks.split(","))) for c in cases)
    budget = args.budget_s if args.budget_s is not None else (0.0 if args.smoke or args.rounds else BUDGET_S)
    rounds = args.rounds if args.rounds is not None else (2 if args.smoke else 100_000 if budget else 8)
    steps = args.block_steps if args.block_steps is not None else (2 if args.smoke else 1)
    ops = args.ops or ("1,2" if args.smoke else "1,16")
    ops_ks = () if ops == "none" or device == "cuda" else tuple(int(k) for k in ops.split(","))
    if budget < 0 or rounds < 1 or steps < 1 or any(k < 1 for k in ops_ks):
        raise ValueError(
            f"--budget-s {budget:g}, --rounds {rounds}, --block-steps {steps}, --ops {ops}: a budget "
            "must not be negative, rounds, block steps and every K must be at least 1"
        )
    return {
        "device": device,
        "variants": () if args.no_timing else variants,
        "sweep": sweep_names,
        "cases": cases,
        "budget_s": budget,
        "rounds": rounds,
        "block_steps": steps,
        "ops_ks": ops_ks,
        "world": args.world or (torch.cuda.device_count() if device == "cuda" else 2),
    }


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    try:
        opts = _options(args)
    except ValueError as err:
        print(f"benchmarks.run: {err}", file=sys.stderr)
        return 2
    device, world, cases = opts["device"], opts["world"], opts["cases"]
    sweep_env = SWEEP_CPU_ENV if device == "cpu" else {}
    command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    meta = provenance(command.strip(), device=device, world_size=world, precision=args.precision)
    settings = {
        "smoke": args.smoke,
        "rounds": opts["rounds"],
        "budget_s": opts["budget_s"],
        "block_steps": opts["block_steps"],
        "variants": list(opts["variants"]),
        "sweep_variants": list(opts["sweep"]),
        "sweep_env": sweep_env,
        "ops_ks": list(opts["ops_ks"]),
    }
    case_info = {
        c.name: {
            "about": c.about,
            "params": c.shape.num_params(),
            "micro_batch": c.micro_batch,
            "ks": list(c.ks),
            "sweep_ks": list(c.sweep_ks),
        }
        for c in cases
    }
    started = time.perf_counter()
    parts: dict[str, Any] = {"timing": [], "memory": [], "host_ops": {}}

    def results(finished: bool) -> dict[str, Any]:
        return {
            "meta": meta,
            "settings": settings,
            "cases": case_info,
            "finished": finished,
            "wall_s": round(time.perf_counter() - started, 1),
            **parts,
        }

    args.out.mkdir(parents=True, exist_ok=True)

    def keep(part: str) -> Callable[[Any], None]:
        def write(rows: Any) -> None:  # after every launch: a run stopped part-way keeps what it finished
            parts[part] = rows
            (args.out / "results.json").write_text(json.dumps(results(False), indent=1) + "\n")

        return write

    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="distaccum-bench-") as tmp:
        scratch = Path(tmp)
        if opts["variants"]:
            run_timing(
                cases,
                opts["variants"],
                rounds=opts["rounds"],
                steps=opts["block_steps"],
                budget_s=opts["budget_s"],
                device=device,
                precision=args.precision,
                world=world,
                scratch=scratch,
                timeout=args.timeout,
                done=keep("timing"),
            )
        if opts["sweep"]:
            run_memory(
                cases,
                opts["sweep"],
                device=device,
                precision=args.precision,
                world=world,
                scratch=scratch,
                timeout=args.timeout,
                env=sweep_env,
                done=keep("memory"),
            )
        if opts["ops_ks"]:
            counts, failed = run_ops(opts["ops_ks"], scratch)
            keep("host_ops")(counts)
    final = results(True)
    (args.out / "results.json").write_text(json.dumps(final, indent=1) + "\n")
    markdown = render_results(final, str(args.out / "results.json"))
    (args.out / "results.md").write_text(markdown)
    print(markdown)
    failed += [f"timing {r['case']} K={r['k']}" for r in final["timing"] if r["status"] != "ok"]
    failed += [
        f"memory {r['case']} K={r['k']} {r['variant']}" for r in final["memory"] if r["status"] != "ok"
    ]
    if failed:
        print(f"failed launches: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
