"""Benchmark distaccum against hand-written PyTorch DDP, Accelerate and a compute-only floor.

``python -m benchmarks.run [--smoke] [--rounds N] [--out DIR]`` measures, for every case x K x
variant, one world-2 gloo launch per round; rounds are interleaved with the variant order rotated
each round so slow drift of the machine falls on every variant alike. Each launch reports the
median of its timed optimizer steps; the tables show the median of those over rounds. Writes
``results.json`` and ``results.md`` into ``--out`` and prints the markdown.

Variants: (a) ``ddp_every_micro``, (b) ``ddp_no_sync``, (c) ``accelerate``, (d) ``distaccum``
(``engine=ddp``, ledger on), (d0) ``distaccum_no_ledger``, (e) ``compute_floor``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.baselines import BenchSpec, ModelShape, pool_micro_batches

ROOT = Path(__file__).resolve().parents[1]
WORLD_SIZE = 2
DISTACCUM = ("distaccum", "distaccum_no_ledger")
VARIANTS = (
    "ddp_every_micro",
    "ddp_no_sync",
    "accelerate",
    "distaccum",
    "distaccum_no_ledger",
    "compute_floor",
)
LETTERS = {
    "ddp_every_micro": "a",
    "ddp_no_sync": "b",
    "accelerate": "c",
    "distaccum": "d",
    "distaccum_no_ledger": "d0",
    "compute_floor": "e",
}
# (label, numerator, denominator, what it means)
RATIOS = (
    ("d/b", "distaccum", "ddp_no_sync", "distaccum vs hand-written no_sync (target <= 1.03)"),
    ("a/d", "ddp_every_micro", "distaccum", "speed-up of reducing once per step"),
    ("d/e", "distaccum", "compute_floor", "distaccum vs no communication"),
    ("c/d", "accelerate", "distaccum", "Accelerate vs distaccum"),
    ("d/d0", "distaccum", "distaccum_no_ledger", "ledger overhead (target <= 1.02)"),
    ("a/b", "ddp_every_micro", "ddp_no_sync", "every-micro vs no_sync, hand-written"),
    ("c/b", "accelerate", "ddp_no_sync", "Accelerate vs hand-written no_sync"),
    ("b/e", "ddp_no_sync", "compute_floor", "no_sync vs no communication"),
)


@dataclass(frozen=True, kw_only=True)
class Case:
    """A model and micro-batch measured at several accumulation depths K."""

    name: str
    """Short name used in tables and results.json."""
    about: str
    """One line on what the case stresses."""
    shape: ModelShape
    """The MLP trained by every variant."""
    micro_batch: int
    """Samples per micro-batch per rank."""
    ks: tuple[int, ...]
    """Accumulation depths to measure."""
    micro_budget: int
    """Micro-batches timed per launch; steps = max(min_steps, ceil(micro_budget / K))."""
    min_steps: int = 3
    """Fewest timed optimizer steps per launch."""

    def spec(self, k: int) -> BenchSpec:
        """The measurement at accumulation depth ``k``."""
        # The first micro-batch pays allocation and DDP's bucket rebuild: warm up >= 2 micro-batches.
        return BenchSpec(
            shape=self.shape,
            micro_batch=self.micro_batch,
            accum_steps=k,
            steps=max(self.min_steps, math.ceil(self.micro_budget / k)),
            warmup=math.ceil(2 / k),
        )


FULL_CASES = (
    Case(
        name="comm_heavy",
        about="22M-parameter MLP, micro-batch 2: the all-reduce rivals the compute",
        shape=ModelShape(in_dim=512, width=2048, depth=6, out_dim=16),
        micro_batch=2,
        ks=(1, 4, 16),
        micro_budget=8,
    ),
    Case(
        name="compute_heavy",
        about="1.1M-parameter MLP, micro-batch 512: compute dominates",
        shape=ModelShape(in_dim=1024, width=512, depth=3, out_dim=16),
        micro_batch=512,
        ks=(1, 4, 16),
        micro_budget=8,
    ),
)
SMOKE_CASES = (
    # One K keeps CI under a minute: every launch costs seconds of process start-up.
    Case(
        name="smoke",
        about="tiny MLP, CI smoke run",
        shape=ModelShape(in_dim=16, width=32, depth=2, out_dim=4),
        micro_batch=2,
        ks=(4,),
        micro_budget=4,
        min_steps=2,
    ),
)


@dataclass(kw_only=True)
class Measurement:
    """One launch of one variant."""

    status: str
    """ok | failed | not available."""
    step_s: list[float] = field(default_factory=list)
    """Timed optimizer-step wall times of rank 0, seconds."""
    peak_rss_mb: float | None = None
    """Largest resident-set high-water mark of any process of the launch, MiB."""
    reported_peak_mb: float | None = None
    """distaccum only: the largest ``peak_mem_bytes`` its own records report, MiB."""
    wall_s: float = 0.0
    """Wall time of the whole launch, start-up included."""
    load_1m: float = 0.0
    """1-minute load average when the launch ended; its own two ranks account for about 2."""
    error: str = ""
    """Tail of the output when the launch failed."""

    @property
    def median_s(self) -> float | None:
        """Median timed step, or None without timings."""
        return statistics.median(self.step_s) if self.step_s else None


def free_port() -> int:
    """A TCP port that was free a moment ago (for the gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env(rank: int, port: int) -> dict[str, str]:
    """torchrun-style environment for one baseline rank."""
    env = dict(os.environ)
    env.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "LOCAL_WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            # torchrun's default for nproc > 1; every variant (distaccum included) runs with it.
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        }
    )
    return env


def baseline_argv(variant: str, spec: BenchSpec, out_json: Path) -> list[str]:
    """Command line of one baseline rank."""
    return [sys.executable, "-m", "benchmarks.baselines", variant, spec.to_json(), str(out_json)]


def distaccum_argv(spec: BenchSpec, run_dir: Path, *, ledger: bool, port: int) -> list[str]:
    """Command line of variant (d): ``distaccum train`` configured like the baselines.

    ``++key=value`` sets a field whether or not ``configs/`` spells it out.
    """
    steps = spec.warmup + spec.steps
    fields = {
        "accum.micro_batch": spec.micro_batch,
        "accum.steps": spec.accum_steps,
        "accum.global_batch": "null",
        "accum.sync": "boundary",
        "precision": "fp32",
        # Plain SGD like the baselines: no momentum, schedule, decay or clipping.
        "optim.name": "sgd",
        "optim.lr": spec.lr,
        "optim.momentum": 0.0,
        "optim.weight_decay": 0.0,
        "optim.schedule": "constant",
        "optim.warmup_steps": 0,
        "optim.clip_norm": "null",
        # As much data as each baseline rank holds; a multiple of the window, so none is partial.
        "data.dataset.num_samples": pool_micro_batches(spec.accum_steps) * spec.micro_batch * WORLD_SIZE,
        "data.dataset.seed": spec.seed,
        # The baselines walk their data in order; so does distaccum here (its collate then takes
        # views instead of gathering shuffled rows).
        "data.shuffle": "false",
        "trainer.nproc": WORLD_SIZE,
        "trainer.max_steps": steps,
        "trainer.device": "cpu",
        "trainer.seed": spec.seed,
        "trainer.check_every": 0,
        "trainer.rdzv_endpoint": f"127.0.0.1:{port}",
        "log.console": "quiet",
        "log.ledger": "true" if ledger else "false",
        "log.warmup_steps": spec.warmup,
        "run_dir": str(run_dir),
    }
    return [
        sys.executable,
        "-m",
        "distaccum",
        "train",
        "engine=ddp",
        *spec.shape.distaccum_overrides(),
        *(f"++{key}={value}" for key, value in fields.items()),
    ]


def distaccum_available() -> bool:
    """Whether the distaccum CLI (variant d) can be imported."""
    try:
        return importlib.util.find_spec("distaccum.cli") is not None
    except ImportError:
        return False


def _wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> tuple[list[int], list[float]]:
    """Wait for ``procs``; return exit codes and each process tree's peak RSS in MiB.

    ``os.wait4`` reports the high-water mark of the child and of every descendant it waited for,
    so the same number covers a plain worker and distaccum's launcher with its workers. When one
    process fails or time runs out the others are killed (a lone rank would hang in a collective).
    """
    deadline = time.monotonic() + timeout_s
    codes: dict[int, int] = {}
    rss: dict[int, float] = {}
    while len(codes) < len(procs):
        for proc in procs:
            if proc.pid in codes:
                continue
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                codes[pid] = proc.returncode = os.waitstatus_to_exitcode(status)
                rss[pid] = usage.ru_maxrss / 1024  # KiB on Linux
        if len(codes) < len(procs) and (any(codes.values()) or time.monotonic() > deadline):
            for proc in procs:
                if proc.pid not in codes:
                    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the launch's processes only
                    _, status, usage = os.wait4(proc.pid, 0)
                    codes[proc.pid] = proc.returncode = os.waitstatus_to_exitcode(status) or -9
                    rss[proc.pid] = usage.ru_maxrss / 1024
        time.sleep(0.05)
    return [codes[p.pid] for p in procs], [rss[p.pid] for p in procs]


def _launch(
    argvs: list[list[str]], envs: list[dict[str, str]], log: Path, timeout_s: float
) -> tuple[bool, float, float, str]:
    """Start the processes of one launch; return (ok, peak RSS MiB, wall seconds, output tail)."""
    start = time.perf_counter()
    with log.open("wb") as sink:
        procs = [
            subprocess.Popen(
                argv, env=env, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
            )
            for argv, env in zip(argvs, envs, strict=True)
        ]
        codes, rss = _wait_all(procs, timeout_s)
    wall = time.perf_counter() - start
    ok = not any(codes)
    why = f"timed out after {timeout_s:.0f} s, " if wall >= timeout_s else ""
    tail = "" if ok else f"{why}exit codes {codes}:\n" + log.read_text(errors="replace")[-3000:]
    return ok, max(rss), wall, tail


def measure_baseline(variant: str, spec: BenchSpec, workdir: Path, timeout_s: float) -> Measurement:
    """One world-2 launch of a hand-written baseline."""
    port = free_port()
    outs = [workdir / f"rank{rank}.json" for rank in range(WORLD_SIZE)]
    ok, rss, wall, tail = _launch(
        [baseline_argv(variant, spec, out) for out in outs],
        [worker_env(rank, port) for rank in range(WORLD_SIZE)],
        workdir / "output.log",
        timeout_s,
    )
    if not all(out.exists() for out in outs):
        return Measurement(status="failed", wall_s=wall, error=tail or "a rank wrote no result")
    # Every rank finished and wrote its record: a crash after that (at exit) does not void it.
    rank0 = json.loads(outs[0].read_text())
    return Measurement(
        status="ok",
        step_s=rank0["step_s"],
        peak_rss_mb=rss,
        wall_s=wall,
        error="" if ok else f"measured, then exited abnormally: {tail}",
    )


def read_metrics(metrics: Path, warmup: int) -> tuple[list[float], float | None]:
    """From distaccum's metrics.jsonl: rank 0's ``time_s`` per step after warm-up, and peak MiB."""
    times: list[float] = []
    peaks: list[float] = []
    for line in metrics.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if isinstance(record.get("time_s"), int | float) and record.get("rank", 0) == 0:
            times.append(float(record["time_s"]))
            if isinstance(record.get("peak_mem_bytes"), int | float):
                peaks.append(record["peak_mem_bytes"] / 2**20)
    return times[warmup:], max(peaks, default=None)


def measure_distaccum(spec: BenchSpec, workdir: Path, timeout_s: float, *, ledger: bool) -> Measurement:
    """One ``distaccum train engine=ddp`` launch (it starts its own two workers)."""
    if not distaccum_available():
        return Measurement(status="not available", error="distaccum.cli cannot be imported")
    run_dir = workdir / "run"
    env = worker_env(0, free_port())
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name)  # the distaccum launcher sets these for its own workers
    argv = distaccum_argv(spec, run_dir, ledger=ledger, port=free_port())
    ok, rss, wall, tail = _launch([argv], [env], workdir / "output.log", timeout_s)
    metrics = run_dir / "metrics.jsonl"
    if not ok or not metrics.exists():
        return Measurement(status="failed", wall_s=wall, error=tail or f"{metrics} was not written")
    times, reported_peak = read_metrics(metrics, spec.warmup)
    if not times:
        return Measurement(status="failed", wall_s=wall, error=f"no time_s records in {metrics}")
    return Measurement(
        status="ok", step_s=times, peak_rss_mb=rss, reported_peak_mb=reported_peak, wall_s=wall
    )


def measure(variant: str, spec: BenchSpec, workdir: Path, timeout_s: float) -> Measurement:
    """Dispatch one launch of ``variant``."""
    workdir.mkdir(parents=True, exist_ok=True)
    if variant in DISTACCUM:
        result = measure_distaccum(spec, workdir, timeout_s, ledger=variant == "distaccum")
    else:
        result = measure_baseline(variant, spec, workdir, timeout_s)
    # Other work on the machine shows up here: flag contended timings instead of hiding them.
    result.load_1m = os.getloadavg()[0]
    return result


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_variant(runs: list[Measurement]) -> dict[str, Any]:
    """Median over rounds of each launch's median step, plus the spread and peak memory."""
    per_round = [m.median_s for m in runs if m.status == "ok"]
    statuses = {m.status for m in runs}
    status = "ok" if statuses == {"ok"} else "not available" if statuses == {"not available"} else "failed"
    return {
        "status": status,
        "step_s_median": _median(per_round),
        "step_s_rounds": per_round,
        # The fastest single step: a floor that other load on the machine can only raise.
        "step_s_min": min((t for m in runs for t in m.step_s), default=None),
        "peak_rss_mb": _median([m.peak_rss_mb for m in runs]),
        "reported_peak_mb": _median([m.reported_peak_mb for m in runs]),
        "launch_wall_s": [round(m.wall_s, 2) for m in runs],
        "load_1m": [round(m.load_1m, 2) for m in runs],
        "errors": [m.error for m in runs if m.error],
    }


def compute_ratios(variants: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """Every ratio of :data:`RATIOS` whose two variants were measured (None otherwise)."""
    out: dict[str, float | None] = {}
    for label, num, den, _ in RATIOS:
        a = variants.get(num, {}).get("step_s_median")
        b = variants.get(den, {}).get("step_s_median")
        out[label] = a / b if a is not None and b else None
    return out


def memory_growth(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Peak RSS per rank at the smallest vs the largest K, per case and variant."""
    rows = []
    for name in dict.fromkeys(c["case"] for c in cases):
        entries = sorted((c for c in cases if c["case"] == name), key=lambda c: c["k"])
        low, high = entries[0], entries[-1]
        for variant in VARIANTS:
            a = low["variants"].get(variant, {}).get("peak_rss_mb")
            b = high["variants"].get(variant, {}).get("peak_rss_mb")
            if a is None or b is None:
                continue
            rows.append(
                {
                    "case": name,
                    "variant": variant,
                    "k_low": low["k"],
                    "k_high": high["k"],
                    "rss_k_low_mb": a,
                    "rss_k_high_mb": b,
                    "growth": b / a,
                }
            )
    return rows


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import psutil
    import torch

    cpu = platform.processor() or "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import accelerate

        accelerate_version = accelerate.__version__
    except ImportError:
        accelerate_version = None
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "accelerate": accelerate_version,
        "backend": "gloo",
        "world_size": WORLD_SIZE,
        "threads_per_rank": 1,
    }


def _fmt(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def render_markdown(results: dict[str, Any]) -> str:
    """The three tables of results.md: step times, ratios, memory."""
    m = results["machine"]
    variants = [v for v in VARIANTS if v in results["settings"]["variants"]]
    loads = [x for c in results["cases"] for s in c["variants"].values() for x in s["load_1m"]]
    lines = [
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, {m['memory_gib']} GiB, {m['platform']}; "
        f"torch {m['torch']}, accelerate {m['accelerate']}, {m['backend']}, world {m['world_size']}, "
        f"{m['threads_per_rank']} thread per rank. Rounds: {results['settings']['rounds']}. "
        f"Whole run: {results['wall_s']:.0f} s. 1-minute load average after each launch: median "
        f"{_fmt(_median(loads))}, max {_fmt(max(loads, default=None))} (the benchmark alone: about 2).",
        "",
        "Time per optimizer step, ms (median over rounds of each launch's median step):",
        "",
        "| case | params | micro | K | " + " | ".join(f"{LETTERS[v]} {v}" for v in variants) + " |",
        "|---|---:|---:|---:|" + "---:|" * len(variants),
    ]
    for c in results["cases"]:
        cells = [_fmt(c["variants"][v]["step_s_median"], 1000, 1) for v in variants]
        lines.append(
            f"| {c['case']} | {c['params'] / 1e6:.1f}M | {c['micro_batch']} | {c['k']} | "
            + " | ".join(cells)
            + " |"
        )
    lines += [
        "",
        "Ratios of those medians:",
        "",
        "| case | K | " + " | ".join(label for label, *_ in RATIOS) + " |",
        "|---|---:|" + "---:|" * len(RATIOS),
    ]
    for c in results["cases"]:
        lines.append(
            f"| {c['case']} | {c['k']} | "
            + " | ".join(_fmt(c["ratios"][label], digits=3) for label, *_ in RATIOS)
            + " |"
        )
    lines += [""] + [f"- {label}: {about}" for label, _, _, about in RATIOS]
    lines += [
        "",
        "Peak RSS per process, MiB (median over rounds):",
        "",
        "| case | variant | K low | RSS | K high | RSS | growth |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in results["memory"]:
        lines.append(
            f"| {r['case']} | {LETTERS[r['variant']]} {r['variant']} | {r['k_low']} | "
            f"{r['rss_k_low_mb']:.0f} | {r['k_high']} | {r['rss_k_high_mb']:.0f} | {r['growth']:.3f} |"
        )
    unavailable = sorted(
        {v for c in results["cases"] for v, s in c["variants"].items() if s["status"] == "not available"}
    )
    if unavailable:
        lines += ["", f"Not available: {', '.join(unavailable)} (distaccum.cli cannot be imported)."]
    return "\n".join(lines) + "\n"


def run_benchmark(
    cases: Sequence[Case], variants: Sequence[str], rounds: int, timeout_s: float, scratch: Path
) -> dict[str, Any]:
    """Measure every case x K x variant ``rounds`` times, interleaved; return results.json's content."""
    started = time.perf_counter()
    runs: dict[tuple[str, int, str], list[Measurement]] = {}
    for r in range(rounds):
        order = list(variants[r % len(variants) :]) + list(variants[: r % len(variants)])
        for case in cases:
            for k in case.ks:
                for variant in order:
                    workdir = scratch / f"r{r}" / case.name / f"k{k}" / variant
                    result = measure(variant, case.spec(k), workdir, timeout_s)
                    runs.setdefault((case.name, k, variant), []).append(result)
                    print(
                        f"[round {r + 1}/{rounds}] {case.name} K={k} {variant}: {result.status}, "
                        f"{_fmt(result.median_s, 1000, 1)} ms/step, rss {_fmt(result.peak_rss_mb, digits=0)} MiB, "
                        f"launch {result.wall_s:.1f} s, load {result.load_1m:.2f}",
                        flush=True,
                    )
                    if result.status == "failed":
                        print(result.error, file=sys.stderr, flush=True)
    case_rows = []
    for case in cases:
        for k in case.ks:
            spec = case.spec(k)
            summary = {v: summarize_variant(runs[(case.name, k, v)]) for v in variants}
            case_rows.append(
                {
                    "case": case.name,
                    "about": case.about,
                    "shape": dataclasses.asdict(case.shape),
                    "params": case.shape.num_params(),
                    "micro_batch": case.micro_batch,
                    "k": k,
                    "steps": spec.steps,
                    "warmup": spec.warmup,
                    "variants": summary,
                    "ratios": compute_ratios(summary),
                }
            )
    return {
        "machine": machine_info(),
        "settings": {
            "rounds": rounds,
            "variants": {v: LETTERS[v] for v in variants},
            "timing": "rank 0 wall time per optimizer step; per-launch median, then median over rounds",
            "memory": "largest ru_maxrss of any process of the launch (os.wait4)",
        },
        "cases": case_rows,
        "memory": memory_growth(case_rows),
        "wall_s": time.perf_counter() - started,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, K=4, one round: the CI run")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3, smoke 1)")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "bench", help="results directory")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of variants")
    p.add_argument("--cases", default=None, help="comma-separated subset of case names")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per launch")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, write results.json and results.md, print the markdown; 1 if a launch failed."""
    args = parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    cases = SMOKE_CASES if args.smoke else FULL_CASES
    if args.cases:
        wanted = args.cases.split(",")
        cases = tuple(c for c in cases if c.name in wanted)
        if not cases:
            raise SystemExit(f"no case named {wanted}")
    rounds = args.rounds if args.rounds is not None else (1 if args.smoke else 3)
    if rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {rounds}")
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="distaccum-bench-") as scratch:
        results = run_benchmark(cases, variants, rounds, args.timeout, Path(scratch))
    results["settings"]["smoke"] = args.smoke
    markdown = render_markdown(results)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown)
    print(markdown)
    failed = [
        (c["case"], c["k"], v)
        for c in results["cases"]
        for v, s in c["variants"].items()
        if s["status"] == "failed"
    ]
    if failed:
        print(f"failed launches: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
