"""The operators one optimizer step issues on the host: distaccum's ``Trainer`` against the expert hand-written
``no_sync`` loop, on the same model, data and loss (``python -m benchmarks.host_ops``; ``tests/test_host_ops.py``
holds distaccum to its budget with it).

Both loops train a 3-layer MLP with SGD on the same in-memory tensors, cut into micro-batches by slicing, with the
same summed-MSE loss. Each warms up (DDP rebuilds its buckets after the first step, SGD makes its state), then rank 0
profiles one steady-state optimizer step of each with ``torch.profiler`` while rank 1 steps alongside. Counted: the
top-level ATen operators the step's own thread issues (``aten::*`` events with no parent operator), outside the
user's code (the model's forward and the loss, marked ``user``), the backward (autograd's engine and the DDP
reduction it runs) and the optimizer (``Optimizer.step`` / ``zero_grad``, which torch marks itself): what each loop
does of its own around those. Operators are counted, not timed, so the numbers are exact and the same on every run.

Both loops run the same steady-state step, without the periodic work of either (distaccum's tripwire and straggler
view run every ``trainer.check_every`` / ``log.rank_stats_every`` steps, 10 by default; the profiled step is step 4).

    python -m benchmarks.host_ops            # K = 1 and 16, 2 ranks: a table, and runs/host_ops/results.json

Each launch's rank 0 writes ``{"k": K, "distaccum": {"ops": n, "names": {...}}, "expert": {...}}``; the CLI's
results.json holds them by K beside the code and environment (``python -m benchmarks.report --store`` keeps it in
docs/results/host-ops.json; ``make bench`` counts the same through :mod:`benchmarks.run`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils.data import TensorDataset

import distaccum
from benchmarks.launch import launch, provenance
from distaccum.models import MLP

MICRO, WIDTH, SAMPLES = 4, 32, 4096
EXCLUDED = ("user", "autograd::engine", "Optimizer.", "ProfilerStep")
"""Ranges whose operators are not the loop's own: the user's forward and loss, the backward, the optimizer."""


def model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_dim=WIDTH, width=WIDTH, depth=3, out_dim=WIDTH)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(SAMPLES, WIDTH, generator=gen), torch.randn(SAMPLES, WIDTH, generator=gen)


def user_loss(module: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    """distaccum's loss contract: the summed loss and its item count (here the micro-batch's samples)."""
    x, y = batch
    with record_function("user"):
        return F.mse_loss(module(x), y, reduction="sum"), len(x)


def count(prof: Any) -> dict[str, Any]:
    """Top-level ATen operators of the profiled thread outside the excluded ranges, by name."""
    events = list(prof.events())
    main = next(e.thread for e in events if e.name == "user")  # the profiler's id of the step's thread
    events = [e for e in events if e.thread == main]
    names: collections.Counter[str] = collections.Counter()
    for event in events:
        if not event.name.startswith(("aten::", "c10d::")):
            continue
        parent, inside = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith(("aten::", "c10d::")) or parent.name.startswith(EXCLUDED):
                inside = True
                break
            parent = parent.cpu_parent
        if not inside:
            names[event.name] += 1
    return {"ops": sum(names.values()), "names": dict(sorted(names.items()))}


def profiled(step: Any, rank: int) -> dict[str, Any] | None:
    """Run ``step`` once, profiled on rank 0."""
    if rank != 0:
        step()
        return None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return count(prof)


def expert(k: int, rank: int, world: int, warmup: int) -> dict[str, Any] | None:
    """The hand-written loop an expert writes: DDP with bucket-view gradients, ``no_sync`` off the boundary, the
    micro-batches sliced from the tensors, the summed loss divided by the global item count known up front (fixed
    micro-batches), SGD, gradients zeroed in place."""
    x, y = data()
    ddp = DDP(model(), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    total = MICRO * k * world
    position = [0]

    def step() -> None:
        for i in range(k):
            first = ((position[0] * k + i) * world + rank) * MICRO % SAMPLES
            batch = (
                x[first : first + MICRO],
                y[first : first + MICRO],
            )  # on the CPU: no move (on a GPU: .to(device))
            with contextlib.nullcontext() if i == k - 1 else ddp.no_sync():
                summed, _ = user_loss(ddp, batch)
                (summed / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        position[0] += 1

    for _ in range(warmup):
        step()
    return profiled(step, rank)


def ours(k: int, rank: int, world: int, warmup: int, run_dir: str) -> dict[str, Any] | None:
    """distaccum's Trainer with its defaults (engine ddp, the reduction fingerprint on, console quiet)."""
    x, y = data()
    trainer = distaccum.Trainer(
        {
            "accum": {"micro_batch": MICRO, "steps": k},
            "trainer": {"max_steps": 1000},
            "log": {"console": "quiet"},
            "data": {"shuffle": False},
            "run_dir": run_dir,
        },
        model=model,
        dataset=TensorDataset(x, y),
        loss=user_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
    )
    trainer.train_steps(warmup)
    got = profiled(lambda: trainer.train_steps(1), rank)
    trainer.state.engine.teardown()
    return got


def worker(out: str, k: int) -> int:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = [tmp if rank == 0 else ""]
        dist.broadcast_object_list(run_dir)
        result = {
            "k": k,
            "expert": expert(k, rank, world, warmup=3),
            "distaccum": ours(k, rank, world, 3, run_dir[0]),
        }
        dist.barrier()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def measure(k: int, workdir: Path, timeout_s: float = 300) -> dict[str, Any]:
    """Launch the two ranks at ``k`` and return rank 0's counts."""
    out = workdir / f"host_ops_k{k}.json"
    run = launch(
        "benchmarks.host_ops", ["--worker", str(out), str(k)], 2, workdir / f"host_ops_k{k}.log", timeout_s
    )
    if not run.ok:
        raise RuntimeError(f"host_ops at K = {k} failed: {run.tail}")
    return json.loads(out.read_text())


def extra(counts: dict[int, dict[str, Any]]) -> tuple[float, float]:
    """distaccum's own operators beyond the expert loop's, (per micro-batch, per step), from the counts at the
    smallest and largest K: the difference grows by the per-micro-batch figure with each micro-batch; the rest is
    per step."""
    ks = sorted(counts)
    low, high = counts[ks[0]], counts[ks[-1]]
    d1 = low["distaccum"]["ops"] - low["expert"]["ops"]
    d2 = high["distaccum"]["ops"] - high["expert"]["ops"]
    per_micro = (d2 - d1) / (ks[-1] - ks[0])
    return per_micro, d1 - per_micro * ks[0]


def table(counts: dict[int, dict[str, Any]]) -> str:
    """A Markdown table of the counts, and distaccum's own operators per micro-batch and per step."""
    lines = [
        "| K | expert loop | distaccum | difference | by operator (distaccum - expert) |",
        "|---|---|---|---|---|",
    ]
    for k, got in sorted(counts.items()):
        mine, theirs = got["distaccum"], got["expert"]
        own = collections.Counter(mine["names"])
        own.subtract(theirs["names"])
        shown = ", ".join(f"{name.split('::')[1]} {n:+d}" for name, n in sorted(own.items()) if n)
        lines.append(
            f"| {k} | {theirs['ops']} | {mine['ops']} | {mine['ops'] - theirs['ops']:+d} | {shown} |"
        )
    per_micro, per_step = extra(counts)
    lines.append(
        f"\ndistaccum's own work beyond the expert loop: {per_micro:+.0f} operators per micro-batch, "
        f"{per_step:+.0f} per step."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_ops", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, default=Path("runs/host_ops"))
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "K"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]))
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.host_ops " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = provenance(command.strip(), device="cpu", world_size=2)
    counts = {k: measure(k, args.out.resolve()) for k in args.ks}
    results = {
        "meta": meta,
        "settings": {"smoke": False, "ops_ks": args.ks},
        "finished": True,
        "host_ops": {str(k): got for k, got in counts.items()},
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
