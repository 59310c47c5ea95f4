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

With ``--device cuda`` (one rank per GPU on NCCL, the tensors pinned in host memory, the expert loop moving each
micro-batch with ``.to(device, non_blocking=True)``) it also counts, in the same step, the kernel launches outside
those ranges (``cudaLaunchKernel`` calls) and every host synchronization (``cuda*Synchronize``, blocking
``cudaMemcpy``): what the host pays for on an accelerator, beside the operators.

    python -m benchmarks.host_ops                   # K = 1 and 16, 2 gloo ranks: a table, runs/host_ops/results.json
    python -m benchmarks.host_ops --device cuda     # the same on every GPU of this machine, launches and syncs too
    python -m benchmarks.host_ops --exact           # distaccum with accum.exact=true (int64 fixed-point sums)
    python -m benchmarks.host_ops --engine fsdp     # distaccum on FSDP2 (unclipped); with --exact too
    python -m benchmarks.exact_price --publish      # exact against default, DDP and FSDP2: docs' price table
    python -m benchmarks.host_ops --checksum fsdp   # the reduction checksum's own operators on FSDP2 (zero2: ZeRO-2)

Each launch's rank 0 writes ``{"k": K, "distaccum": {"ops": n, "names": {...}}, "expert": {...}}``; the CLI's
results.json holds them by K beside the code and environment (``python -m benchmarks.report --store`` keeps it in
docs/results/host-ops.json; ``make bench`` counts the same through :mod:`benchmarks.run`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
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
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
"""CUDA runtime and driver calls that launch a kernel."""
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
"""CUDA runtime calls that make the host wait for the device (``cudaMemcpy`` is the blocking copy; the
asynchronous one, ``cudaMemcpyAsync``, is not among them)."""


def model() -> nn.Module:
    torch.manual_seed(0)
    return MLP(in_dim=WIDTH, width=WIDTH, depth=3, out_dim=WIDTH)


def data(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples in host memory (pinned for a GPU run, as an expert keeps data it copies every step)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(SAMPLES, WIDTH, generator=gen), torch.randn(SAMPLES, WIDTH, generator=gen)
    return (x.pin_memory(), y.pin_memory()) if device.type == "cuda" else (x, y)


def user_loss(module: nn.Module, batch: Any) -> tuple[torch.Tensor, int]:
    """distaccum's loss contract: the summed loss and its item count (here the micro-batch's samples)."""
    x, y = batch
    with record_function("user"):
        return F.mse_loss(module(x), y, reduction="sum"), len(x)


def _excluded(event: Any) -> bool:
    """Whether ``event`` runs inside an excluded range (the user's code, the backward, the optimizer)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(EXCLUDED):
            return True
        parent = parent.cpu_parent
    return False


def _top_level(event: Any) -> bool:
    """Whether no operator encloses ``event`` (the operators an operator calls are its own work)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "c10d::")):
            return False
        parent = parent.cpu_parent
    return True


def count(prof: Any, cuda: bool = False) -> dict[str, Any]:
    """Top-level ATen operators of the profiled thread outside the excluded ranges, by name; on CUDA also its kernel
    launches outside them and every host synchronization of the step."""
    events = list(prof.events())
    main = next(e.thread for e in events if e.name == "user")  # the profiler's id of the step's thread
    events = [e for e in events if e.thread == main]
    names: collections.Counter[str] = collections.Counter(
        e.name
        for e in events
        if e.name.startswith(("aten::", "c10d::")) and _top_level(e) and not _excluded(e)
    )
    got: dict[str, Any] = {"ops": sum(names.values()), "names": dict(sorted(names.items()))}
    if cuda:
        got["launches"] = sum(1 for e in events if e.name in LAUNCHES and not _excluded(e))
        got["syncs"] = sum(1 for e in events if e.name in SYNCS)
    return got


def profiled(step: Any, rank: int, device: torch.device) -> dict[str, Any] | None:
    """Run ``step`` once, profiled on rank 0."""
    if rank != 0:
        step()
        return None
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize(
                device
            )  # the step's work done inside the profile (outside the counted ranges)
    return count(prof, cuda)


def expert(k: int, rank: int, world: int, warmup: int, device: torch.device) -> dict[str, Any] | None:
    """The hand-written loop an expert writes: DDP with bucket-view gradients, ``no_sync`` off the boundary, the
    micro-batches sliced from the tensors (moved to a GPU without waiting), the summed loss divided by the global
    item count known up front (fixed micro-batches), SGD, gradients zeroed in place."""
    x, y = data(device)
    cuda = device.type == "cuda"
    ddp = DDP(model().to(device), gradient_as_bucket_view=True, device_ids=[device.index] if cuda else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    total = MICRO * k * world
    position = [0]

    def step() -> None:
        for i in range(k):
            first = ((position[0] * k + i) * world + rank) * MICRO % SAMPLES
            batch = x[first : first + MICRO], y[first : first + MICRO]
            if cuda:  # on the CPU the slices are the batch
                batch = batch[0].to(device, non_blocking=True), batch[1].to(device, non_blocking=True)
            with contextlib.nullcontext() if i == k - 1 else ddp.no_sync():
                summed, _ = user_loss(ddp, batch)
                (summed / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        position[0] += 1

    for _ in range(warmup):
        step()
    return profiled(step, rank, device)


def ours(
    k: int,
    rank: int,
    world: int,
    warmup: int,
    run_dir: str,
    device: torch.device,
    exact: bool = False,
    engine: str | dict[str, Any] = "ddp",
    fingerprint: bool = True,
) -> dict[str, Any] | None:
    """distaccum's Trainer with its defaults (engine ddp, the reduction fingerprint on, console quiet); with ``exact``,
    ``accum.exact=true``; ``engine``: another engine by name (``fsdp``, without clipping) or an ``engine`` section
    as it is (clipping on); ``fingerprint``: ``trainer.fingerprint`` (the reduction checks). Beside the counts: the bytes of gradient the step's
    reduction takes in on this rank (``reduced_bytes``: an exact run's int64 accumulator, else the parameters'
    gradients) and the bytes an exact run keeps for its fixed-point sums (``fixed_point_bytes``), over ``params``."""
    x, y = data(device)
    trainer = distaccum.Trainer(
        {
            "engine": {"name": engine} if isinstance(engine, str) else engine,
            "accum": {"micro_batch": MICRO, "steps": k, "exact": exact},
            # FSDP2 unclipped in both modes: exact mode refuses the sharded norm (a float sum over the shards).
            **({"optim": {"clip_norm": None}} if engine == "fsdp" else {}),
            "trainer": {"max_steps": 1000, "device": device.type, "fingerprint": fingerprint},
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
    got = profiled(lambda: trainer.train_steps(1), rank, device)
    sized = sizes(trainer.state.engine)  # on every rank: FSDP2's full parameters are a collective
    if got is not None:
        got |= sized
    trainer.state.engine.teardown()
    return got


def sizes(engine: Any) -> dict[str, int]:
    """The trained parameters, the bytes the step's reduction takes in on this rank and the fixed-point buffers'
    bytes (0 outside exact mode)."""
    params = sum(p.numel() for _, p in engine.full_parameters())
    fixed = getattr(engine, "fixed", None)
    if fixed is None:
        return {"params": params, "reduced_bytes": params * 4, "fixed_point_bytes": 0, "tensors": 0}  # fp32
    buffers = (fixed.flat, fixed.scaled, fixed.ints, fixed.acc, fixed.scale, fixed.peak)
    return {
        "params": params,
        "reduced_bytes": fixed.bytes_per_step,
        "fixed_point_bytes": sum(t.numel() * t.element_size() for t in buffers),
        "tensors": len(fixed.sizes),
    }


CHECKSUM_ENGINES = {"fsdp": {"name": "fsdp"}, "zero2": {"name": "deepspeed", "zero_stage": 2}}
"""``--checksum NAME``: the sharded engines whose reduction checksum is counted (FSDP2, DeepSpeed ZeRO-2)."""


def worker(out: str, k: int, device_type: str = "cpu", variants: list[str] | None = None) -> int:
    """One launch's rank: the expert loop, then distaccum in each of ``variants`` (``ENGINE`` or ``ENGINE+exact``,
    each in a run directory of its own; the first is the result's ``distaccum``, every one under ``variants``). A
    variant ``checksum=NAME`` instead counts the same Trainer on :data:`CHECKSUM_ENGINES`'s ``NAME`` with its
    reduction checksum off (the result's ``expert``) and on (``distaccum``)."""
    torch.set_num_threads(1)
    cuda = device_type == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = [tmp if rank == 0 else ""]
        dist.broadcast_object_list(run_dir)
        checksum = next((v.split("=", 1)[1] for v in variants or [] if v.startswith("checksum=")), "")
        if checksum:
            section = CHECKSUM_ENGINES[checksum]
            off = ours(
                k, rank, world, 3, os.path.join(run_dir[0], "off"), device, engine=section, fingerprint=False
            )
            on = ours(k, rank, world, 3, os.path.join(run_dir[0], "on"), device, engine=section)
            variants = []
        result: dict[str, Any] = {
            "k": k,
            "expert": off if checksum else expert(k, rank, world, 3, device),
            "variants": {f"{checksum}+checksum": on} if checksum else {},
        }
        for name in variants or ([] if checksum else ["ddp"]):
            engine, _, mode = name.partition("+")
            directory = os.path.join(run_dir[0], name)
            result["variants"][name] = ours(k, rank, world, 3, directory, device, mode == "exact", engine)
        result["distaccum"] = next(iter(result["variants"].values()))
        dist.barrier()
    if rank == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def world_for(device: str) -> int:
    """The ranks a launch runs: 2 gloo ranks on the CPU, one rank per GPU on CUDA."""
    return torch.cuda.device_count() if device == "cuda" else 2


def measure(
    k: int,
    workdir: Path,
    timeout_s: float = 300,
    device: str = "cpu",
    exact: bool = False,
    variants: list[str] | None = None,
    checksum: str = "",
) -> dict[str, Any]:
    """Launch the ranks at ``k`` and return rank 0's counts (``exact``: distaccum with ``accum.exact=true``;
    ``variants``: several of distaccum's in the one launch, see :func:`worker`; ``checksum``: a
    :data:`CHECKSUM_ENGINES` entry, its run with the checksum off in place of the expert loop)."""
    variants = [f"checksum={checksum}"] if checksum else variants or (["ddp+exact"] if exact else ["ddp"])
    tag = (
        "" if variants == ["ddp"] else "_" + "_".join(v.replace("+", "-").replace("=", "_") for v in variants)
    )
    out = workdir / f"host_ops_{device}{tag}_k{k}.json"
    log = workdir / f"host_ops_{device}{tag}_k{k}.log"
    argv = ["--worker", str(out), str(k), device, *variants]
    env = {"DS_ACCELERATOR": "cpu"} if device == "cpu" else None  # ZeRO-2's checksum count on the CPU
    run = launch("benchmarks.host_ops", argv, world_for(device), log, timeout_s, env)
    if not run.ok:
        raise RuntimeError(f"host_ops at K = {k} failed: {run.tail}")
    return json.loads(out.read_text())


def extra(counts: dict[int, dict[str, Any]], what: str = "ops") -> tuple[float, float]:
    """distaccum's own operators (or ``what``: launches, syncs) beyond the expert loop's, (per micro-batch, per step),
    from the counts at the smallest and largest K: the difference grows by the per-micro-batch figure with each
    micro-batch; the rest is per step."""
    ks = sorted(counts)
    low, high = counts[ks[0]], counts[ks[-1]]
    d1 = low["distaccum"][what] - low["expert"][what]
    d2 = high["distaccum"][what] - high["expert"][what]
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
    if all("launches" in got["distaccum"] for got in counts.values()):
        launches, syncs = extra(counts, "launches"), extra(counts, "syncs")
        lines.append(
            f"Kernel launches of its own: {launches[0]:+.0f} per micro-batch, {launches[1]:+.0f} per step; host "
            f"synchronizations: {syncs[0]:+.0f} per micro-batch, {syncs[1]:+.0f} per step."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.host_ops", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", type=Path, default=Path("runs/host_ops"))
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--exact", action="store_true", help="count distaccum with accum.exact=true")
    parser.add_argument("--engine", choices=["ddp", "fsdp"], default="ddp", help="distaccum's engine")
    parser.add_argument(
        "--checksum",
        choices=sorted(CHECKSUM_ENGINES),
        help="count the reduction checksum on this sharded engine: the run with trainer.fingerprint=false in place "
        "of the expert loop",
    )
    parser.add_argument("--worker", nargs="+", metavar="OUT K DEVICE [VARIANT...]", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), args.worker[2], args.worker[3:])
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks.host_ops " + " ".join(sys.argv[1:] if argv is None else argv)
    meta = provenance(command.strip(), device=args.device, world_size=world_for(args.device))
    variant = args.engine + ("+exact" if args.exact else "")
    counts = {
        k: measure(
            k, args.out.resolve(), device=args.device, variants=[variant], checksum=args.checksum or ""
        )
        for k in args.ks
    }
    settings = {"exact": args.exact, "engine": args.engine, "checksum": args.checksum}
    results = {
        "meta": meta,
        "settings": {"smoke": False, "ops_ks": args.ks, **settings},
        "finished": True,
        "host_ops": {str(k): got for k, got in counts.items()},
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(table(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
