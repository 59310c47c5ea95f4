"""Is a step's allocation peak growing with K, or only sampled more often? ``python -m benchmarks.memory_peaks``.

tests/test_memory_flat.py measures one step's allocation peak (torch.profiler allocator events, max over the 2
ranks) at K = 1, 2 and 8. This diagnostic measures it for ``--steps`` consecutive steps at each K, for each
MODE of that test (default: fsdp, fsdp_every_micro, zero3, and ddp as a control), in one 2-rank launch, and
prints every step's peak. If the peak of a K = 8 step lies within the range that single-micro-batch steps
(K = 1, or K = 2 for the modes that keep a window's gradient from the second micro-batch on) reach over
as many micro-batches, the growth is the maximum of more draws of a peak that varies from micro-batch to
micro-batch (when asynchronous collectives free their buffers), not memory kept per micro-batch.

    python -m benchmarks.memory_peaks [MODE ...] [--steps 8] [--ks 1,2,8]
"""

from __future__ import annotations

import argparse
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


def _worker(plan_file: str) -> None:
    import torch.distributed as dist
    from test_memory_flat import step_peaks  # the test's own measurement

    from conftest import plan_worker

    peaks: dict[str, list[float]] = {}

    def collecting(loss: Any) -> Any:
        def wrapped(model: Any, batch: Any) -> Any:
            gc.collect()  # free unreachable reference cycles (and what they hold) before every micro-batch
            return loss(model, batch)
        return wrapped

    def measure(values: dict[str, Any]) -> None:
        steps, collect = int(values.pop("_steps")), bool(values.pop("_collect"))
        measured = step_peaks(values, steps, wrap_loss=collecting if collect else None)
        peaks[Path(values["run_dir"]).name] = [peak / 2**20 for peak in measured]

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
                plan.append({**to_mapping(cfg), "_steps": args.steps, "_collect": args.collect})
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
            values = peaks[f"{mode}-k{k}"]
            print(f"  {mode:<18} K={k:<2} min {min(values):7.2f}  max {max(values):7.2f}   "
                  + " ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        main()
