"""Does growing the global batch pay? A fixed small batch, a fixed large one, a ramp and the adaptive batch (issue 49).

``python -m benchmarks.batch_growth [--samples N] [--target LOSS] [--out DIR] [--smoke] [--publish | --render]``
trains tiny_gpt on the packaged demo text (``data=text_files``: CPython's documentation topics, byte-level, packed
into blocks of 64 tokens, every 20th block held out; ``loss=causal_ce``) on 2 CPU ranks (gloo, DDP), micro-batch 8
per rank, four times over the same sample stream:

- **fixed small**: 16 samples per optimizer step (K = 1);
- **fixed large**: 128 samples per step (K = 8);
- **ramp**: Megatron's ``--rampup-batch-size 16 16 N/2`` to 128 (``accum.ramp.start/increment/samples``): 16 at
  first, +16 each time another N/14 samples have been read, 128 after half the budget;
- **adaptive**: ``accum.adaptive`` from 16, bounded by [16, 128], a decision every 20 steps from step 20 (``log.gns``).

The optimizer is the same for all: AdamW, lr 3e-3, constant after 5 warm-up steps, ``optim.lr_scaling=none`` (the
learning rate does not follow the batch: the comparison is of the batch alone). Every run reads the same samples in
the same order (the ramp and the adaptive batch cut the stream into windows of other sizes), up to a budget of
``--samples`` samples (``trainer.max_samples``: each run stops after the step whose samples reach it, so the
adaptive batch, whose step count is not known in advance, trains no further); evaluation on the held-out blocks every ~1,000 samples (every ``ceil(1000 / G)`` steps of the
starting batch G; the ramp and the adaptive batch every 10 steps).

For each run the table gives what it took to first reach ``--target`` eval loss (nats per token): samples, optimizer
steps, bytes the rank put into gradient all-reduces (rank 0's ``comm_bytes``, summed), and wall time (the steps'
``time_s``, summed: training only, without start-up and evaluations) — at the first evaluation at or below the
target, so each figure is resolved to that run's evaluation cadence. Wall time on a 2-core shared machine is for
orientation only.

Writes ``results.json``, ``results.md`` and ``batch-growth.png`` into ``--out`` and prints the table. ``--publish``
also keeps the results as :data:`STORE` and renders docs/planning.md's ``bench:batch_growth`` section (table and
figure, :data:`FIGURE`); ``--render`` re-renders it from :data:`STORE` without training.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.launch import ROOT, provenance, train_cli
from benchmarks.report import replace_section, study_markdown, write_study
from distaccum.rundir import read_evals, read_metrics
from distaccum.telemetry.summary import run_samples
from distaccum.units import human_bytes

STORE = ROOT / "docs" / "results" / "batch-growth.json"
"""The stored result docs/planning.md's table and figure are rendered from."""
FIGURE = ROOT / "docs" / "figures" / "batch-growth.png"
DOC = ROOT / "docs" / "planning.md"
DOCS_COMMAND = "python -m benchmarks.batch_growth --publish"
WORLD = 2
MICRO = 8
SMALL, LARGE = 16, 128
BASE = (
    "model=tiny_gpt",
    "data=text_files",
    "loss=causal_ce",  # next-token prediction: text_files' labels are its inputs, causal_ce shifts them
    f"trainer.nproc={WORLD}",
    f"accum.micro_batch={MICRO}",
    "optim.schedule=constant",
    "optim.warmup_steps=5",
    "optim.lr=3e-3",
    "eval.at_start=true",
    "eval.micro_batch=32",
    "log.console=quiet",
    "trainer.resume=false",
    "trainer.save_final=false",
)


@dataclass(frozen=True)
class Variant:
    """One training run of the comparison."""

    name: str
    label: str
    kind: str
    """fixed | ramp | adaptive."""
    batch: int
    """The global batch it starts with (fixed: keeps)."""

    def overrides(self, samples: int) -> list[str]:
        if self.kind == "fixed":
            return [f"accum.global_batch={self.batch}", f"eval.every={math.ceil(1000 / self.batch)}"]
        if self.kind == "ramp":
            return [
                f"accum.global_batch={LARGE}",
                f"accum.ramp.start={SMALL}",
                f"accum.ramp.increment={SMALL}",
                f"accum.ramp.samples={samples // 2}",
                "eval.every=10",
            ]
        return [
            f"accum.global_batch={SMALL}",
            "log.gns=true",
            "accum.adaptive.enabled=true",
            f"accum.adaptive.min_batch={SMALL}",
            f"accum.adaptive.max_batch={LARGE}",
            "accum.adaptive.every=20",
            "accum.adaptive.warmup=20",
            "eval.every=10",
        ]

    def max_steps(self, samples: int) -> int:
        """A bound on the optimizer steps that read ``samples`` samples: as many as the starting batch, the smallest
        the run takes, needs. ``trainer.max_samples`` ends the run at the budget (:func:`arguments`): the ramp's and
        the adaptive batch's step counts are not this bound's."""
        return math.ceil(samples / self.batch)


VARIANTS = (
    Variant("fixed-small", f"fixed {SMALL}", "fixed", SMALL),
    Variant("fixed-large", f"fixed {LARGE}", "fixed", LARGE),
    Variant("ramp", f"ramp {SMALL}→{LARGE}", "ramp", SMALL),
    Variant("adaptive", f"adaptive [{SMALL}, {LARGE}]", "adaptive", SMALL),
)


def arguments(variant: Variant, samples: int, run_dir: Path) -> list[str]:
    """``distaccum train``'s overrides for ``variant``: it stops after the step whose samples reach the budget."""
    return [
        *BASE,
        f"trainer.max_steps={variant.max_steps(samples)}",
        f"trainer.max_samples={samples}",
        *variant.overrides(samples),
        f"run_dir={run_dir}",
    ]


def train(variant: Variant, samples: int, out: Path) -> tuple[Path, float]:
    """Train ``variant`` into ``out/<name>`` (the ``distaccum train`` CLI); its run directory and wall time."""
    run_dir = out / variant.name
    return run_dir, train_cli(variant.label, arguments(variant, samples, run_dir))


def summarize(
    variant: Variant, records: list[dict[str, Any]], evals: list[dict[str, Any]], samples: int, target: float
) -> dict[str, Any]:
    """One run's curve (samples, steps, bytes, wall and eval loss at every evaluation within the budget), where it
    first reached ``target``, and the batches it took (pure)."""
    read = sent = 0
    wall = 0.0
    at: dict[int, tuple[int, int, float]] = {0: (0, 0, 0.0)}
    batches = []
    for r in records:
        read += run_samples(r)
        sent += int(r["comm_bytes"])
        wall += float(r["time_s"])
        at[int(r["step"])] = (read, sent, wall)
        if not batches or batches[-1][1] != int(r["global_batch"]):
            batches.append((int(r["step"]), int(r["global_batch"])))
    curve = [
        {
            "step": int(e["step"]),
            "samples": at[int(e["step"])][0],
            "bytes": at[int(e["step"])][1],
            "wall_s": at[int(e["step"])][2],
            "eval_loss": float(e["eval_loss"]),
        }
        for e in evals
        if at[int(e["step"])][0] <= samples
    ]
    reached = next((p for p in curve if p["eval_loss"] <= target), None)
    decisions = [
        {
            "step": int(r["step"]),
            "noise_scale": r["adaptive_noise_scale"],
            "next": int(r["adaptive_next_batch"]),
        }
        for r in records
        if "adaptive_next_batch" in r
    ]
    return {
        "name": variant.name,
        "label": variant.label,
        "kind": variant.kind,
        "reached": reached,
        "final_eval_loss": curve[-1]["eval_loss"],
        "final": curve[-1],
        "batches": batches,
        "decisions": decisions,
        "curve": curve,
    }


def render(results: dict[str, Any], figure: str | None = None) -> str:
    """The markdown table (and the figure's link, ``figure`` relative to the page) of a stored result."""
    s = results["settings"]
    lines = [
        f"| run | samples to {s['target']:.2f} | optimizer steps | bytes all-reduced (rank 0) | wall (steps) | "
        f"eval loss at {s['samples']:,} samples | global batches taken |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        hit = r["reached"]
        cells = (
            [f"{hit['samples']:,}", f"{hit['step']}", human_bytes(hit["bytes"]), f"{hit['wall_s']:.1f} s"]
            if hit
            else ["not reached", "", "", ""]
        )
        taken = ", ".join(f"{b} (from step {step})" for step, b in r["batches"][:6]) + (
            ", ..." if len(r["batches"]) > 6 else ""
        )
        lines.append(f"| {r['label']} | {' | '.join(cells)} | {r['final_eval_loss']:.3f} | {taken} |")
    meta = results["meta"]
    about = (
        f"tiny_gpt ({s['params']:,} parameters, fp32) on the packaged demo text, {WORLD} CPU ranks (gloo, DDP), "
        f"micro-batch {MICRO} per rank; AdamW lr 3e-3, constant after 5 warm-up steps, the same for every run "
        f"(`optim.lr_scaling=none`); budget {s['samples']:,} samples, the same stream in every run; eval loss on "
        f"{s['eval_tokens']:,} held-out tokens. The figures are at the first evaluation at or below the target. "
        f"Wall time: the steps' own time on a shared {meta['logical_cpus']}-core machine, for orientation only."
    )
    return study_markdown(lines, about, meta, figure, "eval loss against samples, optimizer steps and bytes")


def plot(results: dict[str, Any], path: Path) -> None:
    """Three panels: eval loss against samples read, against optimizer steps, against bytes all-reduced."""
    import matplotlib  # the report extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "fixed-small": "tab:blue",
        "fixed-large": "tab:orange",
        "ramp": "tab:green",
        "adaptive": "tab:red",
    }
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    target = results["settings"]["target"]
    for r in results["runs"]:
        kw = {"color": colors.get(r["name"], "black"), "marker": "o", "markersize": 2.5, "linewidth": 1.3}
        curve = r["curve"]
        axes[0].plot(
            [p["samples"] / 1e3 for p in curve], [p["eval_loss"] for p in curve], label=r["label"], **kw
        )
        later = [p for p in curve if p["step"] > 0]  # step 0 cannot sit on the log axes
        axes[1].plot([p["step"] for p in later], [p["eval_loss"] for p in later], label=r["label"], **kw)
        axes[2].plot(
            [p["bytes"] / 2**20 for p in later], [p["eval_loss"] for p in later], label=r["label"], **kw
        )
    for ax, xlabel in zip(
        axes,
        ("samples read (thousands)", "optimizer steps", "bytes all-reduced by rank 0 (MiB)"),
        strict=True,
    ):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out eval loss (nats per token)")
        ax.set_ylim(*results["settings"]["plot_ylim"])
        ax.grid(alpha=0.3)
    axes[1].set_xscale("log")
    axes[2].set_xscale("log")
    axes[0].legend(fontsize=8)
    axes[0].set_title("per sample")
    axes[1].set_title("per optimizer step (log)")
    axes[2].set_title("per byte all-reduced (log)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def publish(results: dict[str, Any], doc: Path = DOC) -> None:
    """Render docs/planning.md's generated section and the figure from ``results``."""
    plot(results, FIGURE)
    text = doc.read_text(encoding="utf-8")
    body = render(results, FIGURE.relative_to(doc.parent).as_posix())
    doc.write_text(replace_section(text, "batch_growth", body, DOCS_COMMAND), encoding="utf-8")


def run_all(
    variants: tuple[Variant, ...], samples: int, target: float, out: Path, command: str
) -> dict[str, Any]:
    """Train every variant and gather the comparison (``command``: the invocation, for the record)."""
    runs, meta = [], provenance(command, device="cpu", world_size=WORLD)
    eval_tokens = params = 0
    for v in variants:
        run_dir, wall = train(v, samples, out)
        evals = read_evals(run_dir)
        records = read_metrics(run_dir)
        eval_tokens = int(evals[-1]["eval_items"])
        params = params or int(records[0]["comm_bytes"]) // 4
        runs.append({**summarize(v, records, evals, samples, target), "launch_s": wall})
        hit = runs[-1]["reached"]
        print(
            f"batch_growth: {v.label}: final eval loss {runs[-1]['final_eval_loss']:.4f}, target "
            + (f"reached at {hit['samples']} samples, step {hit['step']}" if hit else "not reached")
            + f" ({wall:.0f} s)",
            flush=True,
        )
    losses = [p["eval_loss"] for r in runs for p in r["curve"] if p["step"] > 0]
    return {
        "meta": meta,
        "settings": {
            "samples": samples,
            "target": target,
            "world": WORLD,
            "micro_batch": MICRO,
            "eval_tokens": eval_tokens,
            "params": params,
            "overrides": list(BASE),
            "plot_ylim": [math.floor(min(losses) * 10) / 10 - 0.1, min(max(losses), 4.0) + 0.1],
        },
        "runs": runs,
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.batch_growth",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--samples", type=int, default=24_000, help="the sample budget of every run")
    parser.add_argument("--target", type=float, default=2.0, help="the eval loss to reach (nats per token)")
    parser.add_argument("--out", type=Path, default=Path("runs/batch-growth"))
    parser.add_argument("--smoke", action="store_true", help="a 640-sample budget (structure, not figures)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--publish", action="store_true", help=f"also keep {STORE.relative_to(ROOT)}, render the docs"
    )
    what.add_argument("--render", action="store_true", help="render docs/planning.md from the stored result")
    args = parser.parse_args(argv)
    if args.render:
        publish(json.loads(STORE.read_text()))
        print(f"batch_growth: rendered {DOC.relative_to(ROOT)} and {FIGURE.relative_to(ROOT)}")
        return
    if args.smoke and args.publish:
        raise SystemExit("--publish refuses a --smoke run: its figures are structure only")
    samples = 640 if args.smoke else args.samples
    command = shlex.join(["python", "-m", "benchmarks.batch_growth", *argv])
    results = run_all(VARIANTS, samples, args.target, args.out, command)
    results["settings"]["smoke"] = args.smoke
    print(write_study(results, args.out, "batch-growth.png", render, plot))
    if args.publish:
        STORE.write_text(json.dumps(results, indent=2) + "\n")
        publish(results)
        print(f"batch_growth: kept {STORE.relative_to(ROOT)}, rendered {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main(sys.argv[1:])
