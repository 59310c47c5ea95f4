"""Is a step's allocation peak growing with K, or only sampled more often? ``python -m benchmarks.memory_peaks``.

tests/test_memory_flat.py measures one step's allocation peak (torch.profiler allocator events, max over the 2
ranks) at K = 1, 2 and 8. This diagnostic measures it for ``--steps`` consecutive steps at each K, for each
MODE of that test (default: fsdp, fsdp_every_micro, zero3, and ddp as a control), in one 2-rank launch, and
prints every step's peak. If the peak of a K = 8 step lies within the range that single-micro-batch steps
(K = 1, or K = 2 for the modes that keep a window's gradient from the second micro-batch on) reach over
as many micro-batches, the growth is the maximum of more draws of a peak that varies from micro-batch to
micro-batch (when asynchronous collectives free their buffers), not memory kept per micro-batch.

    python -m benchmarks.memory_peaks [MODE ...] [--steps 8] [--ks 1,2,8] [--collect] [--per-micro]

``--per-micro`` splits every step at its micro-batches (a profiler range entered before each loss): what the
allocator held when each micro-batch started (allocated since the step began and not freed: anything kept
per micro-batch shows as a rising start) and each micro-batch's own peak, and beside it what glibc's malloc
held, over every thread, at each micro-batch's start beyond the first's (:func:`malloc_in_use`: it sees the
frees of blocks allocated before the step, which the profiler does not report).
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
DEFAULT_MODES = ("ddp", "fsdp", "fsdp_every_micro", "zero3")


MARK = "distaccum.memory_peaks.micro_batch"
"""The profiler range entered at the start of every micro-batch (``--per-micro``)."""


def per_micro(events: list[tuple[int, int]], marks: list[int]) -> list[float]:
    """Split one step's allocation events at the micro-batches' starts: for each micro-batch, the running sum of
    allocations since the step began when it starts (``held``: what earlier micro-batches left allocated) and
    its peak; then the step's peak. Flat ``[held_1, peak_1, ..., held_K, peak_K, step_peak]``."""
    out: list[float] = []
    live = peak = 0
    held, micro_peak, at = 0, 0, 0
    bounds = [*marks[1:], None]
    for start_ns, nbytes in events:
        while bounds[at] is not None and start_ns >= bounds[at]:  # type: ignore[operator]
            out += [held, micro_peak]
            held = micro_peak = live
            at += 1
        live += nbytes
        peak, micro_peak = max(peak, live), max(micro_peak, live)
    while len(out) < 2 * len(marks):  # micro-batches after the last event
        out += [held, micro_peak]
        held = micro_peak = live
    return [*out, peak]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.cache
def _mallinfo2() -> Any:
    try:
        call = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    call.restype = _MallInfo2
    return call


def malloc_in_use() -> float:
    """Bytes glibc's malloc has handed out and not yet taken back, over every thread of the process (arena
    chunks + mmapped chunks, ``mallinfo2``: glibc >= 2.33); NaN where there is no such call. Unlike the
    profiler's count it sees every free, also of blocks allocated before the step (it also counts the
    profiler's own event buffers, which grow a little with every operator)."""
    call = _mallinfo2()
    if call is None:
        return float("nan")
    info = call()
    return float(info.uordblks + info.hblkhd)


def _worker(plan_file: str) -> None:
    import torch
    import torch.distributed as dist
    from test_memory_flat import allocation_events, step_peak_bytes, step_peaks  # the test's own measurement

    from conftest import plan_worker

    peaks: dict[str, list[list[float]]] = {}
    starts: list[float] = []  # malloc_in_use() as each micro-batch starts (--per-micro)

    def wrapping(collect: bool, mark: bool) -> Any:
        def wrap(loss: Any) -> Any:
            def wrapped(model: Any, batch: Any) -> Any:
                if collect:
                    gc.collect()  # free unreachable reference cycles (and what they hold) before every micro-batch
                if mark:
                    starts.append(malloc_in_use())
                    with torch.profiler.record_function(MARK):
                        pass
                return loss(model, batch)
            return wrapped
        return wrap

    def split(step: Any) -> list[float]:
        """:func:`per_micro` of the step, then what malloc held at each micro-batch's start beyond the first's."""
        starts.clear()
        figures = per_micro(*allocation_events(step, MARK))
        return [*figures, *(held - starts[0] for held in starts)]

    def measure(values: dict[str, Any]) -> None:
        steps, collect, micro = int(values.pop("_steps")), bool(values.pop("_collect")), bool(values.pop("_micro"))
        figures = step_peaks(values, steps, wrap_loss=wrapping(collect, micro),
                             measure=split if micro else step_peak_bytes)
        peaks[Path(values["run_dir"]).name] = [[v / 2**20 for v in f] for f in figures]

    def write() -> None:
        if dist.get_rank() == 0:
            (Path(plan_file).parent / "peaks.json").write_text(json.dumps(peaks))

    plan_worker(plan_file, measure, after=write)


def main(argv: list[str] | None = None) -> None:
    import test_memory_flat as flat

    from conftest import plan_env
    from distaccum.cli.compose import compose_config
    from distaccum.config import to_mapping, with_overrides

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modes", nargs="*", metavar="MODE", help=f"of {', '.join(flat.MODES)} (default: "
                        f"{' '.join(DEFAULT_MODES)})")
    parser.add_argument("--steps", type=int, default=8, help="profiled steps per (mode, K)")
    parser.add_argument("--ks", default="1,2,8")
    parser.add_argument("--collect", action="store_true",
                        help="run Python's cycle collector (gc.collect) before every micro-batch")
    parser.add_argument("--per-micro", action="store_true",
                        help="split each step at its micro-batches: what each starts holding, and its peak")
    args = parser.parse_args(argv)
    args.modes = args.modes or list(DEFAULT_MODES)
    unknown = [m for m in args.modes if m not in flat.MODES]
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(unknown)}")
    ks = [int(k) for k in args.ks.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        plan = []
        for mode in args.modes:
            for k in ks:
                cfg = with_overrides(compose_config([*flat.MODEL, *flat.MODES[mode], f"accum.steps={k}",
                                                     f"trainer.max_steps={args.steps + 1}"]),
                                     {"run_dir": str(root / f"{mode}-k{k}")})
                plan.append({**to_mapping(cfg), "_steps": args.steps, "_collect": args.collect,
                             "_micro": args.per_micro})
        (root / "plan.json").write_text(json.dumps(plan))
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               "-m", "benchmarks.memory_peaks", "--worker", str(root / "plan.json")],
                              cwd=ROOT, env=plan_env(), capture_output=True, text=True, timeout=1800)
        if proc.returncode:
            sys.exit(f"the launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        peaks = json.loads((root / "peaks.json").read_text())
    print(f"allocation peak of each step, MiB (max over 2 ranks), {args.steps} steps per (mode, K):")
    for mode in args.modes:
        for k in ks:
            steps = peaks[f"{mode}-k{k}"]
            values = [f[2 * k] if args.per_micro else f[0] for f in steps]  # the step's peak
            print(f"  {mode:<18} K={k:<2} min {min(values):7.2f}  max {max(values):7.2f}   "
                  + " ".join(f"{v:.2f}" for v in values))
            if args.per_micro:  # each step: held at the start of micro-batch m -> its peak; malloc's in-use growth
                for f in steps:
                    print(" " * 26 + "profiler " + "  ".join(f"{f[2 * m]:.2f}->{f[2 * m + 1]:.2f}" for m in range(k)))
                    print(" " * 26 + "malloc   " + "  ".join(f"+{f[2 * k + 1 + m]:.2f}" for m in range(k)))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        main()
