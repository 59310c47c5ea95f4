"""Benchmark distaccum's loop against hand-written DDP, Accelerate and a communication-free floor.

``python -m benchmarks.run [--smoke] [--rounds N] [--out DIR] ...``:

1. **Timing** (:mod:`benchmarks.interleave`): per case and K, one world of processes holds every
   variant and alternates them block by block for ``--rounds`` rounds with a rotating order; the
   tables give medians and spreads of per-round ratios.
2. **Engine sweep** (:mod:`benchmarks.sweep`): per case, K in the case's ``sweep_ks`` and engine
   variant, fresh processes: peak memory (flat in K?) and distaccum's per-step communication
   records (rounds, calls, bytes, FSDP2 all-gathers).

Writes ``results.json`` (everything, every round) and ``results.md`` (the tables) into ``--out``,
prints the markdown, exits 1 if any launch failed. ``python -m benchmarks.update_docs`` puts the
tables into BENCHMARKS.md. With CUDA present (``--device auto``), it runs on NCCL with CUDA-event
timing and adds MFU and NCCL bus bandwidth.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.cases import FULL_CASES, GPU_CASES, LIMIT_CASES, SMOKE_CASES, Case, launch_spec
from benchmarks.device import cuda_present, mfu, peak_tflops
from benchmarks.launch import ROOT, Launch, launch
from benchmarks.report import MEMORY_LIMIT, render
from benchmarks.stats import spread, summarize_launch
from benchmarks.variants import DEFAULT_VARIANTS, ENGINE_VARIANTS, check_variants

HSDP_SWEEP = ("distaccum_fsdp", "distaccum_hsdp_boundary", "distaccum_hsdp_replica_boundary",
              "distaccum_hsdp_every_micro")
"""FSDP2 flat and hybrid (2 replicas) in each sync mode: ``--sweep hsdp --world 4`` (2 replicas x 2 shards)."""
DIAGNOSTICS = ("distaccum_copied_rows", "distaccum_device_totals", "distaccum_folded_k1", "distaccum_host_allreduce",
               "distaccum_in_loss", "distaccum_loader", "distaccum_gloo_window", "distaccum_sync_records")
"""distaccum variants that price one choice of the loop (the window's totals, where K = 1 normalizes, how the data
is fed, when records are made), not engines."""
SWITCHES = ("distaccum_no_ledger", "distaccum_no_fingerprint", "distaccum_no_checks", "distaccum_grad_norm")
"""distaccum variants that turn one of the product's per-step switches off or on, to price it."""
SWEEP_VARIANTS = ("ddp_no_sync", *(v for v in ENGINE_VARIANTS
                                   if v not in (*SWITCHES, "distaccum_compiled", *DIAGNOSTICS, *HSDP_SWEEP[1:])))
"""The engine sweep: every engine variant but HSDP's (which needs a world of 4), the cost switches and the
diagnostics, and the hand-written no_sync loop as a reference."""
SWEEP_CPU_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
"""The engine sweep's workers on CPU: glibc's mmap threshold fixed at its default 128 KiB. Left
dynamic, glibc raises it to the size of the largest block freed so far, after which blocks of
that size come from the heap and stay resident when freed; peak RSS then grows with the number
of allocations (K micro-batches) instead of what is alive at once. Fixed, every tensor of 128 KiB
or more is its own mapping, returned on free, and peak RSS follows the live tensors, as the CUDA
allocator's peak does on GPU. The same for every variant, hand-written ones included."""
SMOKE_SWEEP = ("ddp_no_sync", "distaccum", "distaccum_fsdp", "distaccum_zero2")
"""The CI sweep: one of each kind of engine (DeepSpeed's first use compiles an op: ~40 s, once)."""


def _launch_info(result: Launch) -> dict[str, Any]:
    return {"ok": result.ok, "wall_s": round(result.wall_s, 2), "rank_max_rss_mb": round(result.peak_rss_mb, 1),
            "load_1m": [round(x, 2) for x in result.load_1m], "error": result.tail}


def run_timing(cases: Sequence[Case], variants: tuple[str, ...], rounds: int, device: str, world: int,
               scratch: Path, timeout: float, precision: str = "fp32",
               done: Callable[[list[dict[str, Any]]], None] | None = None, repeats: int = 1,
               block_steps: int | None = None, budget_s: float = 0.0) -> list[dict[str, Any]]:
    """One interleaved launch per case and K, ``repeats`` times over (every case and K, then again: the launches
    of one split spread over the run); ``done(rows so far)`` after each launch. ``block_steps`` and ``budget_s``:
    :func:`benchmarks.cases.launch_spec` and :attr:`benchmarks.cases.Spec.budget_s`."""
    rows: list[dict[str, Any]] = []
    for repeat, case in ((r, c) for r in range(repeats) for c in cases):
        for k in case.ks:
            spec = launch_spec(case, k, rounds=rounds, block_steps=block_steps, budget_s=budget_s, variants=variants,
                               device=device, precision=precision)
            name = f"timing-{case.name}-k{k}" + (f"-r{repeat}" if repeats > 1 else "")
            out, work = scratch / f"{name}.json", scratch / name
            result = launch("benchmarks.interleave", [spec.to_json(), str(out), str(work)], world,
                            work / "output.log", timeout)
            if out.exists():  # rank 0 wrote it after every rank finished measuring
                row = summarize_launch(json.loads(out.read_text()))
            else:
                row = {"case": case.name, "k": k, "variants": {}, "ratios": {}, "param_rel_diff": {},
                       "distaccum_ledger": {}, "steps_per_block": spec.steps, "rounds": rounds}
            row["launch"] = _launch_info(result)
            row["status"] = "ok" if out.exists() else "failed"
            row["repeat"], row["repeats"] = repeat, repeats
            rows.append(row)
            ratio = row["ratios"].get("distaccum / no_sync")
            print(f"[timing] {case.name} K={k}" + (f" launch {repeat + 1}/{repeats}" if repeats > 1 else "")
                  + f": {row['status']}, {result.wall_s:.0f} s, load "
                  f"{result.load_1m[1]:.2f}" + (f", distaccum / no_sync {ratio['median']:.3f}" if ratio else ""),
                  flush=True)
            if not result.ok:
                print(result.tail, file=sys.stderr, flush=True)
            if done is not None:
                done(rows)
    return rows


def _sync_of(variant: str) -> str:
    if variant not in ENGINE_VARIANTS:
        return "no_sync (hand-written)"
    return str(ENGINE_VARIANTS[variant][1].get("accum.sync", "boundary"))


def run_sweep(cases: Sequence[Case], variants: tuple[str, ...], device: str, world: int, scratch: Path,
              timeout: float, env: dict[str, str] | None = None, precision: str = "fp32",
              done: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """One fresh launch per case, K and variant (``env`` added to the workers' environment); ``done(rows so
    far)`` after each launch."""
    rows: list[dict[str, Any]] = []
    for case in cases:
        for k in case.sweep_ks:
            for variant in variants:
                spec = launch_spec(case, k, variants=(variant,), device=device, precision=precision)
                out, work = scratch / f"sweep-{case.name}-k{k}-{variant}.json", scratch / f"sweep-{case.name}-k{k}-{variant}"
                result = launch("benchmarks.sweep", [spec.to_json(), str(out), str(work)], world,
                                work / "output.log", timeout, env=env)
                row: dict[str, Any] = {"case": case.name, "k": k, "variant": variant, "sync": _sync_of(variant),
                                       "status": "ok" if out.exists() else "failed", "launch": _launch_info(result)}
                if out.exists():
                    rec = json.loads(out.read_text())
                    row.update({"step_s": spread(rec["step_s"]).as_dict(), "records": rec["records"],
                                **{key.replace("_bytes", "_mb"): rec[key] / 2**20
                                   for key in ("setup_peak_bytes", "step_peak_bytes", "process_peak_bytes")}})
                rows.append(row)
                print(f"[sweep] {case.name} K={k} {variant}: {row['status']}, {result.wall_s:.0f} s"
                      + (f", step peak {row['step_peak_mb']:.0f} MiB" if out.exists() else ""), flush=True)
                if not result.ok:
                    print(result.tail, file=sys.stderr, flush=True)
                if done is not None:
                    done(rows)
    return rows


def memory_growth(sweep: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and variant: peaks at the smallest and the largest K of the sweep."""
    rows = []
    for case in dict.fromkeys(r["case"] for r in sweep):
        for variant in dict.fromkeys(r["variant"] for r in sweep):
            runs = sorted((r for r in sweep if r["case"] == case and r["variant"] == variant and r["status"] == "ok"),
                          key=lambda r: r["k"])
            if len(runs) < 2:
                continue
            low, high = runs[0], runs[-1]
            step, proc = high["step_peak_mb"] / low["step_peak_mb"], high["process_peak_mb"] / low["process_peak_mb"]
            rows.append({"case": case, "variant": variant, "k_low": low["k"], "k_high": high["k"],
                         "step_peak_low_mb": low["step_peak_mb"], "step_peak_high_mb": high["step_peak_mb"],
                         "step_growth": step, "process_peak_low_mb": low["process_peak_mb"],
                         "process_peak_high_mb": high["process_peak_mb"], "process_growth": proc,
                         "flat": step <= MEMORY_LIMIT and proc <= MEMORY_LIMIT})
    return rows


def gpu_summary(timing: list[dict[str, Any]], cases: Sequence[Case], world: int,
                override: float | None, precision: str = "fp32") -> dict[str, Any]:
    """MFU of every variant's median step (against the peak of the precision computed in), and each
    launch's NCCL bus bandwidth."""
    import torch

    peak, source = peak_tflops(precision, override)
    by_name = {c.name: c for c in cases}
    rows = []
    for row in timing:
        case = by_name[row["case"]]
        for name, v in row["variants"].items():
            step = v["step_s"]["median"]
            rows.append({"case": row["case"], "k": row["k"], "variant": name, "step_ms": step * 1e3,
                         "mfu": mfu(case.shape.num_params(), case.micro_batch * row["k"], step, peak)})
    busbw = [{"case": row["case"], "k": row["k"], **row["busbw"]} for row in timing if row.get("busbw")]
    return {"device": torch.cuda.get_device_name(0), "world_size": world, "peak_tflops": peak,
            "peak_source": source, "precision": precision, "mfu": rows, "busbw": busbw}


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import psutil

    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            cpu = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), cpu)
    except OSError:
        pass

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"cpu": cpu, "logical_cpus": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "platform": platform.platform(), "python": platform.python_version(), "torch": version("torch"),
            "accelerate": version("accelerate"), "deepspeed": version("deepspeed")}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, K=1,2, 2 rounds, small sweep: the CI run")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds per launch (default 8; smoke 2)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench", help="results directory")
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all of the size)")
    p.add_argument("--ks", default=None, help="comma-separated K values for the timing (default: the case's)")
    p.add_argument("--block", type=int, default=None, help="micro-batches timed per variant per round: a block is "
                   "ceil(BLOCK / K) optimizer steps, at least the case's minimum (default: the case's, 16 on the full cases)")
    p.add_argument("--block-steps", type=int, default=None, help="optimizer steps per block at every K (instead of "
                   "--block's micro-batches): 1 alternates the variants step by step, which gives the most rounds, so the "
                   "narrowest interval, for the same machine time (docs/benchmarks.md)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds of rounds per launch: whole cycles of rounds "
                   "until the time is spent (--rounds is then the most; default 100000), so every case and K gets the "
                   "same machine time whatever its step")
    p.add_argument("--repeat", type=int, default=1, help="launches per case and K (default 1): with several, each "
                   "ratio's verdict is taken across the launches (their medians), which a single launch cannot show")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help="variants interleaved in the timing")
    p.add_argument("--sweep", default=None, help="engine-sweep variants ('none' skips the sweep; 'hsdp': FSDP2 "
                   "flat and hybrid in each sync mode, with --world 4)")
    p.add_argument("--no-timing", action="store_true", help="only the engine sweep")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="cuda when present (auto)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="what every variant computes in: "
                   "fp32, or bf16 autocast (the hand-written loops' forward and distaccum's precision=bf16)")
    p.add_argument("--world", type=int, default=None, help="ranks (default: 2 on CPU, every GPU on CUDA)")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU peak for MFU when the device is unknown")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per launch")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; write results.json and results.md; 1 if any launch failed, 2 for bad options.

    SIGTERM (a ``timeout``, a batch system, a lease that ends) becomes SystemExit: the launch in progress
    kills its ranks on the way out (:func:`benchmarks.launch.launch`), and results.json keeps the launches
    already finished."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    try:
        variants = tuple(v for v in args.variants.split(",") if v)
        sweep_names = SMOKE_SWEEP if args.smoke else SWEEP_VARIANTS
        if args.sweep is not None:
            named = {"none": (), "hsdp": HSDP_SWEEP}
            sweep_names = named[args.sweep] if args.sweep in named else tuple(v for v in args.sweep.split(",") if v)
        check_variants(list(variants))
        for name in sweep_names:
            check_variants([name])
        cases: tuple[Case, ...] = SMOKE_CASES if args.smoke else FULL_CASES
        if args.cases:
            wanted = args.cases.split(",")
            known = SMOKE_CASES if args.smoke else FULL_CASES + GPU_CASES + LIMIT_CASES
            unknown = [name for name in wanted if name not in {c.name for c in known}]
            if unknown:
                raise ValueError(f"--cases {args.cases}: no case {', '.join(unknown)}; choose from "
                                 f"{', '.join(c.name for c in known)}")
            cases = tuple(c for c in known if c.name in wanted)
        if args.ks:
            ks = tuple(int(k) for k in args.ks.split(","))
            cases = tuple(dataclasses.replace(c, ks=ks) for c in cases)
        if args.block is not None:
            if args.block < 1:
                raise ValueError(f"--block must be >= 1, got {args.block}")
            cases = tuple(dataclasses.replace(c, micro_budget=args.block) for c in cases)
        if args.block_steps is not None and args.block is not None:
            raise ValueError("--block and --block-steps: give one (micro-batches per block, or optimizer steps)")
        if args.block_steps is not None and args.block_steps < 1:
            raise ValueError(f"--block-steps must be >= 1, got {args.block_steps}")
        if args.budget_s is not None and not args.budget_s > 0:
            raise ValueError(f"--budget-s must be positive, got {args.budget_s}")
        budget_cap = 100_000 if args.budget_s is not None else 8
        rounds = args.rounds if args.rounds is not None else (2 if args.smoke else budget_cap)
        if rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {rounds}")
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        device = "cuda" if args.device == "cuda" or (args.device == "auto" and cuda_present()) else "cpu"
        if device == "cuda" and not cuda_present():
            raise ValueError("--device cuda, but CUDA is not available here")
    except ValueError as err:
        print(f"benchmarks.run: {err}", file=sys.stderr)
        return 2
    if rounds < 6 and not args.smoke and args.budget_s is None:
        print(f"note: {rounds} rounds; figures for the record need at least 6", file=sys.stderr)
    import torch

    world = args.world or (torch.cuda.device_count() if device == "cuda" else 2)
    sweep_env = SWEEP_CPU_ENV if device == "cpu" else {}
    started = time.perf_counter()
    settings = {"command": "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv),
                "smoke": args.smoke, "rounds": rounds, "budget_s": args.budget_s, "block_steps": args.block_steps,
                "repeats": args.repeat, "device": device, "world_size": world,
                "backend": "nccl" if device == "cuda" else "gloo", "precision": args.precision,
                "threads": "CUDA" if device == "cuda" else "1 intra-op thread per rank",
                "variants": list(variants), "sweep_variants": list(sweep_names), "sweep_env": sweep_env}

    machine = machine_info()  # read once: results.json is rewritten after every launch
    case_info = {c.name: {"about": c.about, "shape": c.shape.__dict__, "params": c.shape.num_params(),
                          "micro_batch": c.micro_batch, "ks": list(c.ks), "sweep_ks": list(c.sweep_ks)}
                 for c in cases}

    def results_of(timing: list[dict[str, Any]], sweep: list[dict[str, Any]], finished: bool) -> dict[str, Any]:
        return {
            "date": datetime.date.today().isoformat(),
            "machine": machine,
            "settings": settings,
            "finished": finished,
            "cases": case_info,
            "timing": timing,
            "sweep": sweep,
            "memory": memory_growth(sweep),
            "gpu": gpu_summary(timing, cases, world, args.peak_tflops, args.precision) if device == "cuda" else None,
            "wall_s": time.perf_counter() - started,
        }

    args.out.mkdir(parents=True, exist_ok=True)

    def keep(timing: list[dict[str, Any]], sweep: list[dict[str, Any]] | None = None) -> None:
        """The launches so far, so that a run stopped part-way keeps them (``finished`` false)."""
        (args.out / "results.json").write_text(json.dumps(results_of(timing, sweep or [], False), indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="distaccum-bench-") as tmp:
        scratch = Path(tmp)
        timing = [] if args.no_timing else run_timing(cases, variants, rounds, device, world, scratch, args.timeout,
                                                       args.precision, keep, args.repeat, args.block_steps,
                                                       args.budget_s or 0.0)
        sweep = run_sweep(cases, sweep_names, device, world, scratch, args.timeout, sweep_env, args.precision,
                          lambda rows: keep(timing, rows))
    results = results_of(timing, sweep, True)
    markdown = render(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "results.md").write_text(markdown)
    print(markdown)
    failed = [f"timing {r['case']} K={r['k']}" for r in timing if r["status"] != "ok"]
    failed += [f"sweep {r['case']} K={r['k']} {r['variant']}" for r in sweep if r["status"] != "ok"]
    if failed:
        print(f"failed launches: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
