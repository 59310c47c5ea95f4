"""Where distaccum's step differs from the expert hand-written loop's: ``python -m benchmarks.step_profile``.

Two ranks (gloo, one intra-op thread each) build the timing harness's ``ddp_no_sync`` and ``distaccum``
variants of one case at one K (the same model, data and SGD as ``benchmarks.run``), warm both up, then on
rank 0 profile ``--steps`` steps of each with torch.profiler (CPU) and with cProfile. It prints, per
variant: the step times of the profiled block, the operators by self CPU time, the operators and counts
that only one of the two runs (or runs more often), and each variant's own Python functions (distaccum's
and the benchmark's) by cumulative time. Counts are exact; times are as noisy as the machine (run it alone).

With ``--device cuda`` it runs one rank per GPU on NCCL (``--precision bf16`` for bf16 autocast, as
``benchmarks.run``), profiles the CUDA kernels too, and adds per variant the kernels' time per step
(the sum of their self device times) and the rest of the step: time the GPU waited for the host.

    python -m benchmarks.step_profile --case 27.3M_micro4 --k 1 --steps 8
    python -m benchmarks.step_profile --device cuda --precision bf16 --case 210M_micro1024 --k 1
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.cases import FULL_CASES, GPU_CASES, BenchData, Spec, launch_spec
from benchmarks.device import join, step_seconds, worker_main
from benchmarks.interleave import timed_block
from benchmarks.launch import launch
from benchmarks.variants import build_variant

VARIANTS = ("ddp_no_sync", "distaccum")


def _ops(prof: Any) -> dict[str, tuple[int, float]]:
    """Operator -> (calls, self CPU ms) over the profiled block."""
    return {e.key: (e.count, e.self_cpu_time_total / 1e3) for e in prof.key_averages()}


def _device_ms(prof: Any) -> float:
    """The profiled block's kernel time in ms: the self device time of the events that ran on the GPU (what
    torch's own table footer sums; the CPU operators that launched them would count it twice)."""
    return sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e3


def measure(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Warm up both variants, then profile one block of each (every rank steps; rank 0 records)."""
    device, clock = join(spec.device)
    rank = dist.get_rank()
    data = BenchData(spec, dist.get_world_size())
    variants = {name: build_variant(name, spec, data, rank, device, clock, workdir) for name in spec.variants}
    for variant in variants.values():
        timed_block(variant, spec.warmup, clock)
    out: dict[str, Any] = {}
    for name, variant in variants.items():
        dist.barrier()
        if rank == 0:
            cuda = device.type == "cuda"
            with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
                stamps = variant.run(spec.steps)
            clock.sync()
            table = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                              row_limit=18, max_name_column_width=48)
            profiler = cProfile.Profile()
            profiler.enable()
            variant.run(spec.steps)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(r"/(distaccum|benchmarks)/", 40)
            own = io.StringIO()  # every function, torch's own Python included, by the time spent in its body
            pstats.Stats(profiler, stream=own).sort_stats("tottime").print_stats(30)
            out[name] = {"ops": _ops(prof), "table": table, "step_s": step_seconds(clock, stamps),
                         "python": text.getvalue(), "python_own": own.getvalue(),
                         "device_ms": _device_ms(prof) if cuda else None}
        else:
            variant.run(spec.steps)
            variant.run(spec.steps)
    for variant in variants.values():
        variant.close()
    return out


def report(record: dict[str, Any], steps: int, variants: tuple[str, str] = VARIANTS) -> str:
    """The two profiles side by side, and the operators that differ."""
    lines = []
    for name in variants:
        times = record[name]["step_s"]
        median = sorted(times)[len(times) // 2]
        lines += [f"===== {name}: step s {' '.join(f'{t:.4f}' for t in times)} (median {median:.4f})"]
        if record[name].get("device_ms") is not None:
            kernels = record[name]["device_ms"] / steps
            lines.append(f"  kernels {kernels:.3f} ms/step of a {median * 1e3:.3f} ms median step "
                         f"(the GPU waited {median * 1e3 - kernels:.3f} ms/step for the host)")
        lines.append(record[name]["table"])
    a, b = (record[name]["ops"] for name in variants)
    lines.append(f"===== operators {variants[1]} runs more often than {variants[0]} (per step, over {steps} steps)")
    rows = []  # (operator, extra calls, extra self CPU ms), where the call counts differ
    for key in set(a) | set(b):
        (calls_a, ms_a), (calls_b, ms_b) = a.get(key, (0, 0.0)), b.get(key, (0, 0.0))
        if calls_b != calls_a:
            rows.append((key, calls_b - calls_a, ms_b - ms_a))
    for key, calls, ms in sorted(rows, key=lambda row: -abs(row[2])):
        lines.append(f"  {key:<48} calls {calls / steps:+7.1f}/step   self ms {ms / steps:+8.3f}/step")
    lines.append(f"  {'in all':<48} calls {sum(r[1] for r in rows) / steps:+7.1f}/step   "
                 f"self ms {sum(r[2] for r in rows) / steps:+8.3f}/step")
    for name in variants:
        lines.append(f"===== {name}: Python, cumulative (cProfile, one more block)")
        lines.append(record[name]["python"])
        lines.append(f"===== {name}: Python, own time (cProfile, the same block; every function)")
        lines.append(record[name]["python_own"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default=FULL_CASES[0].name, choices=[c.name for c in FULL_CASES + GPU_CASES])
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="the two variants to compare, baseline first (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: 2 ranks on gloo; cuda: one rank per GPU on NCCL, kernels profiled too")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="as benchmarks.run's")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available here")
    variants = tuple(args.variants.split(","))
    if len(variants) != 2:
        parser.error("--variants takes exactly two names")
    case = next(c for c in FULL_CASES + GPU_CASES if c.name == args.case)
    spec = launch_spec(case, args.k, variants=variants, device=args.device, precision=args.precision)
    spec = dataclasses.replace(spec, steps=args.steps, warmup=3, rounds=2)  # two blocks: profiler, cProfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        world = torch.cuda.device_count() if args.device == "cuda" else 2
        result = launch("benchmarks.step_profile", ["--worker", spec.to_json(), str(out), tmp], world,
                        Path(tmp) / "log", timeout_s=900)
        if not result.ok:
            sys.exit(f"the profile launch failed: {result.tail}")
        print(report(json.loads(out.read_text()), args.steps, variants))  # type: ignore[arg-type]


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main("benchmarks.step_profile", measure, Spec.from_json, sys.argv[2:])
    else:
        main()
