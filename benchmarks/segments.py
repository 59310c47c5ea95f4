"""Which device memory segments a step allocates once warm: ``python -m benchmarks.segments`` (CUDA only).

A warm training step should reuse the blocks earlier steps cached; a new segment is a ``cudaMalloc``, which costs
the host a driver call and can wait for the device. One process, one GPU: the timing harness's ``ddp_no_sync`` and
``distaccum`` variants of one case at one K (the same model, data and SGD as ``benchmarks.run``), each warmed up,
then ``--steps`` steps under ``torch.cuda.memory._record_memory_history``. Per variant: the allocator's segment
and device-allocation counters over those steps, the pinned host allocator's counters that changed, and every
segment allocated with the Python frames that asked for it.

    python -m benchmarks.segments --case 0.9M_micro256 --k 1
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from collections import Counter
from pathlib import Path

import torch

from benchmarks.cases import FULL_CASES, GPU_CASES, BenchData, launch_spec
from benchmarks.device import join
from benchmarks.variants import build_variant

COUNTERS = ("segment.all.allocated", "segment.all.freed", "num_alloc_retries", "num_device_alloc", "num_device_free")


def frames(trace: dict) -> list[str]:
    """A trace entry's Python frames as ``file:line:function``, paths from the package or the checkout."""
    return [f"{f['filename'].split('site-packages/')[-1].split(str(Path.cwd()) + '/')[-1]}:{f['line']}:{f['name']}"
            for f in trace.get("frames", [])][:14]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cases = FULL_CASES + GPU_CASES
    parser.add_argument("--case", default=FULL_CASES[1].name, choices=[c.name for c in cases])
    parser.add_argument("--k", type=int, default=1)
    parser.add_argument("--steps", type=int, default=10, help="steps recorded per variant, after 8 warm ones")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="bf16")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA: segments are the CUDA caching allocator's")
    case = next(c for c in cases if c.name == args.case)
    spec = launch_spec(case, args.k, variants=("ddp_no_sync", "distaccum"), device="cuda", precision=args.precision)
    spec = dataclasses.replace(spec, warmup=2, rounds=args.steps + 8, steps=1)  # sizes the Trainer's max_steps
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    device, clock = join("cuda")
    data = BenchData(spec, 1)
    with tempfile.TemporaryDirectory() as tmp:
        for name in spec.variants:
            variant = build_variant(name, spec, data, 0, device, clock, Path(tmp) / name)
            variant.run(8)
            torch.cuda.synchronize()
            before, host_before = torch.cuda.memory_stats(), torch.cuda.host_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
            variant.run(args.steps)
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            after, host_after = torch.cuda.memory_stats(), torch.cuda.host_memory_stats()
            print(f"===== {name}: over {args.steps} steps")
            for key in COUNTERS:
                print(f"  {key}: {after.get(key, 0) - before.get(key, 0)}")
            for key in sorted(host_after):
                if host_after[key] != host_before.get(key):
                    print(f"  host {key}: {host_before.get(key)} -> {host_after[key]}")
            actions: Counter[str] = Counter()
            for trace in snapshot["device_traces"][0]:
                actions[trace["action"]] += 1
                if trace["action"].startswith("segment"):
                    print(f"  {trace['action']} {trace['size']} stream {trace.get('stream')}\n    "
                          + "\n    ".join(frames(trace)))
            print("  actions:", dict(actions))
            variant.close()


if __name__ == "__main__":
    main()
