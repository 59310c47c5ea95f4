"""Eval loss against tokens and against bytes across islands: synchronous training, LocalSGD and DiLoCo (issue 47).

``python -m benchmarks.outer_curves [--steps N] [--eval-every N] [--out DIR] [--smoke] [--publish | --render]``
trains tiny_gpt on the packaged demo text (``data=text_files``: CPython's documentation topics, byte-level,
packed into blocks of 64 tokens, every 20th block held out) with ``loss=causal_ce`` on 4 CPU ranks, once per
variant: synchronous (``outer.method=none``: one DDP group of 4 ranks, a gradient all-reduce every step), then 2
islands of 2 ranks (``outer.islands=2``) with LocalSGD at H = 10 and 50 and DiLoCo at H = 10 and 50 with P = 1
and 4 fragments (fragment p first syncs after floor((p+1) H/P) steps). Every variant takes the same global batch (32 samples: micro-batch 4 x 2
accumulation steps x 4 ranks) from the same deterministic global-batch order, so step s of every run has seen the
same samples: equal steps are equal tokens. Evaluation (every ``--eval-every`` steps, before the first and after the
last) runs on the held-out blocks; an outer-synced run evaluates its global parameters theta_g, the last merged
model (before an island's first sync that is the initial model). The optimizer settings are the default config's
(AdamW lr 3e-3, cosine, 3 warm-up steps) and the outer ones ``outer.*``'s defaults (DiLoCo: SGD lr 0.7, Nesterov
momentum 0.9): nothing tuned.

What crosses between the islands, per island (the definition, the same for every variant): the bytes the island's
ranks put into cross-island all-reduces, summed over its ranks. An outer-synced run records each rank's share as
``comm_bytes_outer`` (its 1/S slice of the fragment under DDP), so an island of S ranks sends S times rank 0's
figure. A synchronous run has no islands; the bytes charged to it are what one island would put into a gradient
all-reduce across the islands each step when reducing hierarchically (inside the island first, then its S ranks
each all-reduce 1/S of the gradient across islands): the whole gradient, rank 0's ``comm_bytes``. Both are payload
into an all-reduce over R islands; a ring moves 2(R-1)/R of the payload over each island's link, the same factor
for every variant, so the reduction factors do not depend on it. Tokens are loss items (predicted tokens). rank 0's
``metrics.jsonl`` counts its own island's samples and items (``samples``, ``items``) and every island's samples
(``run_samples``; a synchronous run's ``samples``); a block holds ``block_size - 1`` items after the causal shift, so
the run's tokens are ``run_samples x (block_size - 1)`` per step, and the script checks that this equals the
synchronous run's ``items`` and R x island 0's ``items`` of an outer-synced run, step by step.

Writes ``results.json``, ``results.md`` and ``outer-curves.png`` into ``--out`` and prints the table. ``--publish``
also keeps the results as :data:`STORE` and renders docs/outer.md's ``bench:outer_curves`` section (table and
figure, :data:`FIGURE`) and its ``bench:outer_plan`` section (``distaccum plan``'s outer prediction, run now);
``--render`` re-renders both sections from :data:`STORE` without training.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.launch import ROOT, provenance, train_cli
from benchmarks.report import replace_section, study_markdown, write_study
from distaccum.rundir import read_config, read_evals, read_metrics
from distaccum.telemetry.summary import run_samples

STORE = ROOT / "docs" / "results" / "outer-curves.json"
"""The stored result docs/outer.md's table and figure are rendered from."""
FIGURE = ROOT / "docs" / "figures" / "outer-curves.png"
DOC = ROOT / "docs" / "outer.md"
DOCS_COMMAND = "python -m benchmarks.outer_curves --publish"
"""The command whose output docs/outer.md carries between its ``bench:outer_curves`` and ``bench:outer_plan``
markers (``--render`` re-renders them from the stored result)."""
PLAN_ARGS = (
    "--nodes 4 --gpus-per-node 8 --compute-ms 120 --params 8e9 accum.global_batch=1024 accum.micro_batch=4 "
    "--island-link-gbps 1"
)
"""The ``distaccum plan`` example docs/outer.md shows."""
ISLANDS = 2
WORLD = 4
BASE = (
    "model=tiny_gpt",
    "data=text_files",
    "loss=causal_ce",  # tiny_gpt's preset selects token_ce, which does not shift: with text_files' labels = inputs
    # that would train a copy of the input, not next-token prediction
    f"trainer.nproc={WORLD}",
    "accum.micro_batch=4",
    "eval.at_start=true",
    "eval.micro_batch=16",
    "log.console=quiet",
    "trainer.resume=false",
)


@dataclass(frozen=True)
class Variant:
    """One training run of the comparison."""

    name: str
    method: str
    """none | local_sgd | diloco."""
    every: int = 0
    fragments: int = 1

    @property
    def label(self) -> str:
        if self.method == "none":
            return "synchronous"
        kind = "LocalSGD" if self.method == "local_sgd" else "DiLoCo"
        return f"{kind} H={self.every}" + (f" P={self.fragments}" if self.method == "diloco" else "")

    def overrides(self) -> list[str]:
        if self.method == "none":
            return ["outer.method=none"]
        return [
            f"outer.method={self.method}",
            f"outer.every={self.every}",
            f"outer.fragments={self.fragments}",
            f"outer.islands={ISLANDS}",
        ]


VARIANTS = (
    Variant("sync", "none"),
    Variant("local_sgd-H10", "local_sgd", 10),
    Variant("local_sgd-H50", "local_sgd", 50),
    Variant("diloco-H10-P1", "diloco", 10, 1),
    Variant("diloco-H10-P4", "diloco", 10, 4),
    Variant("diloco-H50-P1", "diloco", 50, 1),
    Variant("diloco-H50-P4", "diloco", 50, 4),
)
SMOKE = (
    Variant("sync", "none"),
    Variant("local_sgd-H5", "local_sgd", 5),
    Variant("diloco-H5-P5", "diloco", 5, 5),
)


# -- one run ---------------------------------------------------------------------------------------------------------


def train(variant: Variant, steps: int, eval_every: int, global_batch: int, out: Path) -> tuple[Path, float]:
    """Train ``variant`` into ``out/<name>`` (the ``distaccum train`` CLI); its run directory and wall time."""
    run_dir = out / variant.name
    args = [
        *BASE,
        f"trainer.max_steps={steps}",
        f"accum.global_batch={global_batch}",
        f"eval.every={eval_every}",
        *variant.overrides(),
        f"run_dir={run_dir}",
    ]
    return run_dir, train_cli(variant.label, args, timeout_s=1800)


def items_per_sample(config: dict[str, Any]) -> int:
    """Loss items of one packed block: ``block_size - 1`` after the causal shift."""
    dataset, loss = config["data"]["dataset"], config["loss"]
    if not dataset.get("packing", False) or not loss.get("shift", False):
        raise ValueError("the token count needs packed fixed-length blocks and a shifted causal loss")
    return int(dataset["block_size"]) - 1


def summarize(
    variant: Variant,
    records: list[dict[str, Any]],
    evals: list[dict[str, Any]],
    per_sample: int,
    island_size: int,
) -> dict[str, Any]:
    """One run's curve from rank 0's step and eval records (pure): tokens, cumulative bytes across islands per island
    and eval loss at every evaluation, and the run's totals (module docstring for the definitions)."""
    # the islands whose items make up the step's tokens (rank 0's records count island 0's)
    islands = 1 if variant.method == "none" else WORLD // island_size
    tokens, sent, by_step = 0, 0, {0: (0, 0)}
    for r in records:
        step_tokens = run_samples(r) * per_sample
        if int(r["items"]) * islands != step_tokens:
            raise ValueError(
                f"{variant.label} step {r['step']}: {islands} x island 0's {r['items']} items is not samples x "
                f"{per_sample} = {step_tokens}: the islands did not take equal shares of the window"
            )
        tokens += step_tokens
        sent += int(r["comm_bytes"]) if variant.method == "none" else int(r["comm_bytes_outer"]) * island_size
        by_step[int(r["step"])] = (tokens, sent)
    curve = [
        {
            "step": int(e["step"]),
            "tokens": by_step[int(e["step"])][0],
            "bytes": by_step[int(e["step"])][1],
            "eval_loss": float(e["eval_loss"]),
        }
        for e in evals
    ]
    return {
        "name": variant.name,
        "label": variant.label,
        "method": variant.method,
        "every": variant.every,
        "fragments": variant.fragments,
        "steps": len(records),
        "tokens": tokens,
        "bytes_per_island": sent,
        # every island's bytes over every island's tokens (synchronous: charged as the same R islands)
        "bytes_per_token": sent * ISLANDS / tokens if tokens else math.nan,
        "syncs": sum(int(r.get("outer_synced", 0) or 0) for r in records),
        "final_eval_loss": curve[-1]["eval_loss"] if curve else math.nan,
        "final_train_loss": float(records[-1]["loss"]) if records else math.nan,
        "curve": curve,
    }


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``runs`` with each one's eval-loss gap to the synchronous run at every evaluation (equal steps, checked to be
    equal tokens), at the end, and its byte reduction against it over the same tokens (pure)."""
    sync = next(r for r in runs if r["method"] == "none")
    ref = {p["step"]: p for p in sync["curve"]}
    out = []
    for run in runs:
        gaps = []
        for point in run["curve"]:
            base = ref.get(point["step"])
            if base is None:
                continue
            if base["tokens"] != point["tokens"]:
                raise ValueError(f"{run['label']} step {point['step']}: not the synchronous run's tokens")
            gaps.append({"step": point["step"], "gap": point["eval_loss"] - base["eval_loss"]})
        if run["tokens"] != sync["tokens"]:
            raise ValueError(f"{run['label']}: {run['tokens']} tokens, the synchronous run {sync['tokens']}")
        out.append(
            {
                **run,
                "gaps": gaps,
                "final_gap": run["final_eval_loss"] - sync["final_eval_loss"],
                "reduction": sync["bytes_per_island"] / run["bytes_per_island"]
                if run["bytes_per_island"]
                else math.inf,
            }
        )
    return out


# -- rendering -------------------------------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def render(results: dict[str, Any], figure: str | None = None) -> str:
    """The markdown table (and the figure's link, ``figure`` relative to the page) of a stored result."""
    s, runs = results["settings"], results["runs"]
    half = s["steps"] // 2
    lines = [
        "| run | fragment syncs | final eval loss | gap to synchronous half-way | gap at the end | bytes across per "
        "island | bytes per token | reduction vs synchronous | wall |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        at_half = next((g["gap"] for g in r["gaps"] if g["step"] == half), math.nan)
        sync = r["method"] == "none"
        gaps = ("", "") if sync else (f"{at_half:+.3f}", f"{r['final_gap']:+.3f}")
        lines.append(
            f"| {r['label']} | {'every step' if sync else r['syncs']} | {r['final_eval_loss']:.3f} | "
            f"{gaps[0]} | {gaps[1]} | {_size(r['bytes_per_island'])} | {r['bytes_per_token']:.1f} B | "
            f"{r['reduction']:.1f}× | {r['wall_s']:.0f} s |"
        )
    meta = results["meta"]
    about = (
        f"{s['steps']} optimizer steps of {s['global_batch']} samples (half-way: step {half}; {s['tokens']:,} tokens per run, the same "
        f"samples at every step in every run), tiny_gpt ({s['params']:,} parameters, fp32) on the packaged demo "
        f"text, eval loss on {s['eval_tokens']:,} held-out tokens every {s['eval_every']} steps. {WORLD} CPU ranks "
        f"(gloo); outer-synced runs in {ISLANDS} islands of {WORLD // ISLANDS}. Bytes across: what an island puts "
        "into cross-island all-reduces over the run (synchronous: the whole gradient every step). Wall time on a "
        f"shared {meta['logical_cpus']}-core machine, for orientation only."
    )
    return study_markdown(
        lines, about, meta, figure, "eval loss against tokens and against bytes across islands"
    )


def plot(results: dict[str, Any], path: Path) -> None:
    """Two panels: eval loss against tokens, and against cumulative bytes across islands per island (log x; points
    before a run's first sync, at zero bytes, cannot sit on a log axis and are left out)."""
    import matplotlib  # the report extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    styles = {
        "none": ("black", "-"),
        "local_sgd": ("tab:blue", "-"),
        "diloco": ("tab:red", "-"),
    }
    shades = {10: 1.0, 50: 0.55, 5: 1.0}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for r in results["runs"]:
        color, _ = styles[r["method"]]
        alpha = shades.get(r["every"], 1.0)
        dash = "--" if r["fragments"] > 1 else ("-" if r["every"] != 50 else ":")
        if r["method"] == "none":
            dash = "-"
        x = [p["tokens"] / 1e3 for p in r["curve"]]
        y = [p["eval_loss"] for p in r["curve"]]
        kw = {
            "color": color,
            "alpha": alpha,
            "linestyle": dash,
            "marker": "o",
            "markersize": 2.5,
            "linewidth": 1.4,
        }
        left.plot(x, y, label=r["label"], **kw)
        pts = [(p["bytes"], p["eval_loss"]) for p in r["curve"] if p["bytes"] > 0]
        right.plot([b / 2**20 for b, _ in pts], [e for _, e in pts], label=r["label"], **kw)
    top = results["settings"]["plot_ylim"]
    for ax in (left, right):
        ax.set_ylabel("held-out eval loss (nats per token)")
        ax.set_ylim(*top)
        ax.grid(alpha=0.3)
    left.set_xlabel("tokens trained (thousands, all islands)")
    right.set_xlabel("cumulative bytes across islands per island (MiB, log)")
    right.set_xscale("log")
    right.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    left.set_title("eval loss vs tokens (equal global batch and steps)")
    right.set_title("eval loss vs cross-island bytes")
    left.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plan_block() -> str:
    """``distaccum plan``'s outer prediction for the example cluster, under its command."""
    done = subprocess.run(
        [sys.executable, "-m", "distaccum", "plan", *shlex.split(PLAN_ARGS)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return f"```\n$ distaccum plan {PLAN_ARGS}\n{done.stdout.rstrip()}\n```\n"


def publish(results: dict[str, Any], doc: Path = DOC) -> None:
    """Render docs/outer.md's two generated sections and the figure from ``results``."""
    plot(results, FIGURE)
    text = doc.read_text(encoding="utf-8")
    text = replace_section(
        text, "outer_curves", render(results, FIGURE.relative_to(doc.parent).as_posix()), DOCS_COMMAND
    )
    text = replace_section(text, "outer_plan", plan_block(), DOCS_COMMAND)
    doc.write_text(text, encoding="utf-8")


# -- the command -----------------------------------------------------------------------------------------------------


def run_all(
    variants: tuple[Variant, ...], steps: int, eval_every: int, global_batch: int, out: Path, command: str
) -> dict[str, Any]:
    """Train every variant and gather the comparison (``command``: the invocation, for the record)."""
    for v in variants:
        if v.every and (steps % v.every or v.fragments > v.every):
            raise ValueError(f"{v.label}: H must divide --steps ({steps}) and P must not exceed H")
    runs, meta = [], provenance(command, device="cpu", world_size=WORLD)
    per_sample = eval_tokens = params = 0
    for v in variants:
        run_dir, wall = train(v, steps, eval_every, global_batch, out)
        config = read_config(run_dir)
        per_sample = items_per_sample(config)
        island = WORLD if v.method == "none" else WORLD // ISLANDS
        evals = read_evals(run_dir)
        eval_tokens = int(evals[-1]["eval_items"])
        summary = json.loads((run_dir / "summary.json").read_text())
        params = params or int(read_metrics(run_dir)[0]["comm_bytes"]) // 4
        runs.append(
            {
                **summarize(v, read_metrics(run_dir), evals, per_sample, island),
                "wall_s": wall,
                "summary_eval_loss": summary.get("eval_loss"),
            }
        )
        print(
            f"outer_curves: {v.label}: final eval loss {runs[-1]['final_eval_loss']:.4f} ({wall:.0f} s)",
            flush=True,
        )
    finals = [p["eval_loss"] for r in runs for p in r["curve"] if p["step"] >= eval_every]
    return {
        "meta": meta,
        "settings": {
            "steps": steps,
            "eval_every": eval_every,
            "global_batch": global_batch,
            "world": WORLD,
            "islands": ISLANDS,
            "items_per_sample": per_sample,
            "tokens": runs[0]["tokens"],
            "eval_tokens": eval_tokens,
            "params": params,
            "overrides": list(BASE),
            "plot_ylim": [math.floor(min(finals) * 10) / 10 - 0.1, max(finals) + 0.2],
        },
        "runs": compare(runs),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.outer_curves",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("runs/outer-curves"))
    parser.add_argument("--smoke", action="store_true", help="3 variants, 10 steps (structure, not figures)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--publish", action="store_true", help=f"also keep {STORE.relative_to(ROOT)}, render docs/outer.md"
    )
    what.add_argument(
        "--render", action="store_true", help="render docs/outer.md from the stored result, no training"
    )
    args = parser.parse_args(argv)
    if args.render:
        publish(json.loads(STORE.read_text()))
        print(
            f"outer_curves: rendered {DOC.relative_to(ROOT)} and {FIGURE.relative_to(ROOT)} from {STORE.relative_to(ROOT)}"
        )
        return
    if args.smoke and args.publish:
        raise SystemExit("--publish refuses a --smoke run: its figures are structure only")
    steps, eval_every = (10, 5) if args.smoke else (args.steps, args.eval_every)
    command = shlex.join(["python", "-m", "benchmarks.outer_curves", *argv])
    results = run_all(
        SMOKE if args.smoke else VARIANTS, steps, eval_every, args.global_batch, args.out, command
    )
    results["settings"]["smoke"] = args.smoke
    print(write_study(results, args.out, "outer-curves.png", render, plot))
    if args.publish:
        STORE.write_text(json.dumps(results, indent=2) + "\n")
        publish(results)
        print(
            f"outer_curves: kept {STORE.relative_to(ROOT)}, rendered {DOC.relative_to(ROOT)} and {FIGURE.relative_to(ROOT)}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
