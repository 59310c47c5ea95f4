"""The error a compressed gradient reduction adds, per step: the same run with ``accum.reduce_dtype=bf16``
(or fp16) against ``accum.reduce_dtype=fp32``, for each sync mode.

    python -m benchmarks.reduce_error [--dtype bf16] [--k 16] [--steps 6] [--write docs/multinode.md]

Each configuration trains twice through ``distaccum train`` (same seed, data, split and optimizer), once
reducing in fp32 and once in the compressed dtype, and the table shows per step the relative difference of
the gradient norm (a lower bound of the reduced gradient's relative error: |norm(a) - norm(b)| <=
norm(a - b)) and of the loss, and the final parameters' largest difference relative to their largest
magnitude. ``boundary`` compresses once per optimizer step; ``every_micro`` (and HSDP's
``replica_boundary``, whose in-replica reduce-scatter runs every micro-batch) K times. The figures are
rounding, not timing: they do not depend on the machine's load. ``--write`` replaces the generated section
of the document (its ``reduce-error`` markers).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.launch import ROOT
from benchmarks.report import _table
from benchmarks.update_docs import replace_section
from distaccum.rundir import read_metrics
from distaccum.rundir.weights import load_weights

MODEL = ("model=mlp", "model.width=128", "accum.micro_batch=2", "optim.schedule=constant", "trainer.check_every=0",
         "log.console=quiet", "trainer.seed=0")
"""What every run trains: the packaged regression MLP, AdamW at the default lr, no schedule."""
LAYOUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "DDP, 2 ranks": (("engine=ddp", "trainer.nproc=2"), ("boundary", "every_micro")),
    "FSDP2 HSDP, 2 replicas x 2 shards": (("engine=fsdp", "engine.replicas=2", "trainer.nproc=4"),
                                          ("boundary", "replica_boundary", "every_micro")),
}
"""Layout -> (its overrides, the sync modes measured on it)."""


def train(run_dir: Path, overrides: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """One ``distaccum train`` run: its per-step records and final parameters."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "distaccum", "train", *MODEL, *overrides, f"run_dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return read_metrics(run_dir), load_weights(run_dir / "final")


def rel(a: float, b: float) -> float:
    """|a - b| / |b|."""
    return abs(a - b) / abs(b) if b else float("inf")


def measure(dtype: str, k: int, steps: int, scratch: Path) -> list[dict[str, Any]]:
    """Per layout and sync mode, the compressed run's errors against the fp32-reduced one."""
    rows = []
    for layout, (overrides, modes) in LAYOUTS.items():
        for sync in modes:
            common = (*overrides, f"accum.sync={sync}", f"accum.steps={k}", f"trainer.max_steps={steps}")
            tag = f"{layout.split(',')[0].replace(' ', '-')}-{sync}"
            exact, exact_params = train(scratch / f"{tag}-fp32", (*common, "accum.reduce_dtype=fp32"))
            low, low_params = train(scratch / f"{tag}-{dtype}", (*common, f"accum.reduce_dtype={dtype}"))
            param_err = max(float((low_params[n].double() - p.double()).abs().max()) for n, p in exact_params.items())
            optim = json.loads((scratch / f"{tag}-fp32" / "config.json").read_text())["optim"]
            b1, b2 = optim["betas"]  # AdamW: an element moves at most k lr per step (verify.compare.with_reduction)
            bound = 2 * max(1.0, (1 - b1) / math.sqrt(1 - b2)) * optim["lr"] * steps
            rows.append({"layout": layout, "sync": sync, "k": k, "bytes": (exact[-1]["comm_bytes"],
                                                                          low[-1]["comm_bytes"]),
                         "grad_norm": [rel(b["grad_norm"], a["grad_norm"]) for a, b in zip(exact, low, strict=True)],
                         "loss": [rel(b["loss"], a["loss"]) for a, b in zip(exact, low, strict=True)],
                         "params": param_err, "params_bound": bound})
            print(f"[reduce_error] {layout}, {sync}: done", flush=True)
    return rows


def render(rows: list[dict[str, Any]], dtype: str, command: str) -> str:
    """The markdown of the generated section."""
    steps = len(rows[0]["grad_norm"])
    table = [[r["layout"], r["sync"], ", ".join(f"{e:.1e}" for e in r["grad_norm"]),
              ", ".join(f"{e:.1e}" for e in r["loss"]), f"{r['params']:.1e} ({r['params'] / r['params_bound']:.2f})",
              f"{r['bytes'][1]} / {r['bytes'][0]}"] for r in rows]
    return "\n".join([
        f"Command: `{command}` (K = {rows[0]['k']}, {steps} optimizer steps, torch {torch.__version__}). Per step "
        f"1..{steps}: |x_{dtype} - x_fp32| / |x_fp32| of the gradient norm and of the loss between the run that "
        f"reduces in {dtype} and the same run reducing in fp32; final parameters: max |difference| (in brackets: "
        "its fraction of verify's bound 2 k lr T, AdamW); bytes: `comm_bytes` of a step "
        f"({dtype} / fp32; HSDP: inside a replica).",
        "",
        *_table(["layout", "accum.sync", "grad_norm, per step", "loss, per step", "final params",
                 "bytes / step"], table, "ll"),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    """Measure, print the table, and with ``--write`` put it into the document."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.reduce_error", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--k", type=int, default=16, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per run")
    p.add_argument("--write", type=Path, default=None, help="document whose reduce-error section to replace")
    args = p.parse_args(argv)
    command = "python -m benchmarks.reduce_error " + " ".join(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory(prefix="distaccum-reduce-error-") as tmp:
        rows = measure(args.dtype, args.k, args.steps, Path(tmp))
    text = render(rows, args.dtype, command.strip())
    print(text)
    if args.write:
        args.write.write_text(replace_section(args.write.read_text(), "reduce-error", text,
                                              by="python -m benchmarks.reduce_error --write"))
        print(f"reduce_error: wrote the reduce-error section of {args.write}", file=sys.stderr)
    (ROOT / "runs").mkdir(exist_ok=True)
    (ROOT / "runs" / "reduce_error.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

