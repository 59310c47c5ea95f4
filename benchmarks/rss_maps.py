"""Which of a rank's memory mappings grow over a window: ``python -m benchmarks.rss_maps VARIANT [--ks 1,2,16]``.

A diagnostic for peak RSS that grows with the number of micro-batches K where the live tensors do not seem to
(``benchmarks.memory_census`` sees only tensors Python tracks). Two ranks (gloo) run the distaccum variant
(``benchmarks.variants.ENGINE_VARIANTS``, e.g. ``distaccum_zero2_every_micro``) on a case's model, with glibc's
mmap threshold fixed as in the engine sweep (``benchmarks.run.SWEEP_CPU_ENV``), for each K in its own launch:
two warm-up steps, then one step read from ``/proc/self/smaps`` at the start of every micro-batch (when the loss
function is entered) and after the step. Each reading holds the resident KiB of every mapping and the peak RSS
since the previous reading (``VmHWM``, reset after each: :func:`distaccum.telemetry.memory.reset_peak_memory`). For DeepSpeed ZeRO-1/2
it also reads where the window's gradient accumulator lives (the optimizer's ``all_grad_tensors``: this rank's
partition of the summed gradient, kept from the first micro-batch's reduction to the step).

It prints, per K, the step's peak RSS on each rank and the peak during micro-batch 1 against micro-batches 2..K;
and for the largest K, per rank, the mappings whose resident memory grew from micro-batch 1's start to micro-batch
2's (a mapping the kernel merged with a neighbour shows as growth of that neighbour) and the accumulator's bytes
and which mapping holds them, and the same for the parameters' gradients (``.grad``: DDP's buckets, FSDP2's local
shards).

    python -m benchmarks.rss_maps distaccum_zero2_every_micro --ks 1,2,16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks import variants
from benchmarks.cases import FULL_CASES, SMOKE_CASES, BenchData, Spec, launch_spec
from benchmarks.device import join, worker_main
from benchmarks.launch import launch
from distaccum.telemetry.memory import peak_memory_bytes, reset_peak_memory

MAPPING = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \d+\s*(.*)$")
MiB = 1024.0


def read_smaps(text: str) -> dict[int, tuple[int, int, str]]:
    """``/proc/<pid>/smaps`` -> start address -> (size KiB, resident KiB, name)."""
    maps: dict[int, tuple[int, int, str]] = {}
    start = None
    for line in text.splitlines():
        found = MAPPING.match(line)
        if found:
            start = int(found.group(1), 16)
            maps[start] = ((int(found.group(2), 16) - start) // 1024, 0, found.group(3).strip())
        elif line.startswith("Rss:") and start is not None:
            size, _, name = maps[start]
            maps[start] = (size, int(line.split()[1]), name)
    return maps


CPU = torch.device("cpu")


def storages(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """(data pointer, bytes) of each distinct storage under ``tensors`` (views count their storage once)."""
    return sorted({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.items())


def accumulator(trainer: Any) -> list[tuple[int, int]]:
    """The storages holding a DeepSpeed ZeRO-1/2 optimizer's window accumulator (``all_grad_tensors``); empty for
    any other engine or when it holds none."""
    optimizer = getattr(getattr(trainer.state.engine, "engine", None), "optimizer", None)
    held = getattr(optimizer, "all_grad_tensors", None)
    groups = held.values() if isinstance(held, dict) else held or []
    return storages(t for group in groups for t in (group or []) if t is not None)


def gradients(trainer: Any) -> list[tuple[int, int]]:
    """The storages holding the parameters' ``.grad`` on this rank (a sharded gradient's local shard; DDP's bucket
    views count their buckets once)."""
    grads = (p.grad for p in trainer.state.model.parameters() if p.grad is not None)
    return storages(g.to_local() if hasattr(g, "to_local") else g for g in grads)


def measure(spec: Spec, workdir: Path) -> dict[str, Any]:
    """Warm up two steps, then read the mappings at every micro-batch of one more step (every rank)."""
    device, clock = join(spec.device)
    readings: list[dict[str, Any]] = []
    variant: Any = None
    base_loss = variants.loss_sum

    def read(label: str) -> None:
        readings.append({"label": label, "peak_kib": peak_memory_bytes(CPU) // 1024,
                         "accumulator": accumulator(variant.trainer),
                         "gradients": gradients(variant.trainer),
                         "maps": read_smaps(Path("/proc/self/smaps").read_text())})
        reset_peak_memory(CPU)  # the next reading's peak is the one since this one

    def loss(model: Any, batch: Any) -> Any:
        if reading:
            read(f"micro {sum(r['label'].startswith('micro') for r in readings) + 1}")
        return base_loss(model, batch)

    reading = False
    variants.loss_sum = loss  # the Trainer takes the loss when it is built
    data = BenchData(spec, dist.get_world_size())
    variant = variants.build_variant(spec.engine, spec, data, dist.get_rank(), device, clock, workdir / "run")
    variant.run(spec.warmup)
    reset_peak_memory(CPU)
    reading = True
    variant.run(1)
    read("after the step")
    variant.close()
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [{**r, "maps": {str(k): v for k, v in r["maps"].items()}} for r in readings])
    return {"spec": json.loads(spec.to_json()), "ranks": every}


def mapping_of(maps: dict[str, list[Any]], pointer: int) -> str | None:
    """The start address (hex) of the mapping holding ``pointer``."""
    for start, (size, _, _) in maps.items():
        if int(start) <= pointer < int(start) + size * 1024:
            return hex(int(start))
    return None


def report(records: dict[int, dict[str, Any]]) -> str:
    """Per K the peaks; for the largest K, per rank, what grew between micro-batches 1 and 2 and the accumulator."""
    first = next(iter(records.values()))["spec"]
    lines = [f"{first['engine']}, {first['case']} (micro-batch {first['micro_batch']}), world "
             f"{len(next(iter(records.values()))['ranks'])}; peak RSS MiB per rank (rank 0 / rank 1 ...)", "",
             "| K | step peak | micro-batch 1 | micro-batches 2..K |", "|---:|---:|---:|---:|"]
    for k, record in sorted(records.items()):
        cells = []
        # reading i holds the peak since reading i - 1: micro 2's is micro-batch 1's; the last, micro-batch K's
        for pick in (lambda rs: rs, lambda rs: rs[1:2], lambda rs: rs[2:]):
            cells.append(" / ".join(f"{max(r['peak_kib'] for r in pick(rank)) / MiB:.1f}" if pick(rank) else "-"
                                    for rank in record["ranks"]))
        lines.append(f"| {k} | {' | '.join(cells)} |")
    k, record = max(records.items())
    if k < 2:
        return "\n".join(lines)
    lines += ["", f"K = {k}: mappings whose resident memory grew from micro-batch 1's start to micro-batch 2's "
                  "(MiB), the parameters' gradients and the window's gradient accumulator (DeepSpeed ZeRO-1/2 "
                  "``all_grad_tensors``) there:", ""]
    for rank, readings in enumerate(record["ranks"]):
        before, after = readings[0], readings[1]
        grew = [(start, size, rss - before["maps"].get(start, [0, 0, ""])[1], name)
                for start, (size, rss, name) in after["maps"].items()
                if rss - before["maps"].get(start, [0, 0, ""])[1] >= 1024]
        for start, size, growth, name in sorted(grew, key=lambda g: -g[2]):
            lines.append(f"- rank {rank}: {hex(int(start))} ({size / MiB:.2f} MiB mapping"
                         f"{', ' + name if name else ', anonymous'}{', new' if start not in before['maps'] else ''})"
                         f": +{growth / MiB:.2f} MiB resident")
        for what, key in (("the parameters' gradients", "gradients"), ("the accumulator", "accumulator")):
            if not after[key] and not before[key]:
                continue  # none held (the accumulator: not a ZeRO-1/2 engine)
            held = sum(n for _, n in after[key]) / 2**20
            where = sorted({mapping_of(after["maps"], pointer) for pointer, _ in after[key]} - {None})
            lines.append(f"- rank {rank}: {what} {held:.2f} MiB at micro-batch 2 "
                         f"({sum(n for _, n in before[key]) / 2**20:.2f} at micro-batch 1)"
                         + (f", in mapping {', '.join(where)}" if where else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.run import SWEEP_CPU_ENV

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variant", help="a distaccum variant (benchmarks.variants.ENGINE_VARIANTS)")
    parser.add_argument("--ks", default="1,2,16", help="micro-batches per step, one launch each")
    parser.add_argument("--case", default=FULL_CASES[0].name,
                        choices=[c.name for c in (*FULL_CASES, *SMOKE_CASES)])
    parser.add_argument("--json", type=Path, default=None, help="also write the raw readings here")
    args = parser.parse_args(argv)
    if args.variant not in variants.ENGINE_VARIANTS:
        parser.error(f"{args.variant} is not a distaccum variant: {', '.join(variants.ENGINE_VARIANTS)}")
    case = next(c for c in (*FULL_CASES, *SMOKE_CASES) if c.name == args.case)
    records: dict[int, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in (int(x) for x in args.ks.split(",")):
            spec = dataclasses.replace(launch_spec(case, k), engine=args.variant, steps=1, warmup=2)
            out = Path(tmp) / f"k{k}.json"
            result = launch("benchmarks.rss_maps", ["--worker", spec.to_json(), str(out), f"{tmp}/k{k}"], 2,
                            Path(tmp) / f"k{k}.log", timeout_s=900, env=SWEEP_CPU_ENV)
            if not result.ok:
                sys.exit(f"the K = {k} launch failed: {result.tail}")
            records[k] = json.loads(out.read_text())
    if args.json is not None:
        args.json.write_text(json.dumps(records))
    print(f"Command: python -m benchmarks.rss_maps {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(report(records))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker_main("benchmarks.rss_maps", measure, Spec.from_json, sys.argv[2:])
    else:
        main()
