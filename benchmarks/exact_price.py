"""What exact accumulation (``accum.exact=true``, issue 59) costs, counted: per engine (DDP, FSDP2) the operators
its step issues beyond the default mode's, per micro-batch and per step, the bytes the step's reduction takes in
(int64 against fp32) and the memory its fixed-point sums keep per parameter.

``python -m benchmarks.exact_price [--out DIR] [--publish | --render]`` runs :mod:`benchmarks.host_ops`'s harness
(its MLP, SGD, micro-batch 4, two gloo ranks, one profiled steady-state step on rank 0) at K = 1 and K = 16, with
distaccum's Trainer in each of :data:`VARIANTS`, a launch each. Operators are counted, not timed: the
figures are exact and need no quiet machine. ``--publish`` keeps the result as :data:`STORE` and renders the
``bench:exact_price`` sections of docs/verification.md and BENCHMARKS.md; ``--render`` re-renders them from
:data:`STORE`. ``--device cuda`` counts on the GPUs (NCCL) and adds kernel launches and host synchronizations.

The step time against the default mode at K = 1, 4 and 16 on the benchmark cases is :data:`TIMING_COMMAND`
(:mod:`benchmarks.run`'s alternating timing; it needs a quiet machine). ``--timing [RESULTS]`` keeps that run's
results.json (default ``runs/exact-timing/results.json``) as :data:`TIMING_STORE` and renders the
``bench:exact_timing`` sections: per case and K, each mode's median step time and the median of the per-round ratios
exact / default with its 95 % interval (:func:`benchmarks.stats.spread`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.host_ops import extra, measure, world_for
from benchmarks.launch import ROOT, provenance
from benchmarks.report import replace_section
from benchmarks.stats import per_round_ratios, spread

STORE = ROOT / "docs" / "results" / "exact-price.json"
"""The stored result the ``bench:exact_price`` sections are rendered from."""
DOCS = (ROOT / "docs" / "verification.md", ROOT / "BENCHMARKS.md")
DOCS_COMMAND = "python -m benchmarks.exact_price --publish"
TIMING_COMMAND = (
    "python -m benchmarks.run --cases 0.9M_micro256,27.3M_micro4 --ks 1,4,16 "
    "--variants distaccum,distaccum_exact,distaccum_fsdp,distaccum_fsdp_exact --sweep none --ops none --budget-s 45 "
    "--out runs/exact-timing"
)
TIMING_STORE = ROOT / "docs" / "results" / "exact-timing.json"
"""The stored timing run the ``bench:exact_timing`` sections are rendered from."""
TIMING_DOCS_COMMAND = "python -m benchmarks.exact_price --timing"
TIMED = {"DDP": ("distaccum", "distaccum_exact"), "FSDP2": ("distaccum_fsdp", "distaccum_fsdp_exact")}
"""Per engine, the benchmark's variants of the default mode and of exact mode."""
KS = (1, 16)
ENGINES = {"ddp": "DDP", "fsdp": "FSDP2"}
VARIANTS = [f"{engine}{mode}" for engine in ENGINES for mode in ("", "+exact")]
"""distaccum with the defaults and with ``accum.exact=true``, per engine (``host_ops.worker``'s names)."""


def count(out: Path, device: str = "cpu") -> dict[str, Any]:
    """The counts at each K of :data:`KS`: ``{K: {variant: host_ops counts and sizes}}`` (rank 0's), one launch per
    variant and K (exact mode turns on deterministic algorithms for its whole process)."""
    return {
        str(k): {v: measure(k, out, device=device, variants=[v])["distaccum"] for v in VARIANTS} for k in KS
    }


def price(counts: dict[str, Any], engine: str, what: str = "ops") -> tuple[float, float]:
    """Exact mode's ``what`` (ops, launches, syncs) beyond the default mode's on ``engine``: (per micro-batch, per
    step), from the counts at the smallest and the largest K (:func:`benchmarks.host_ops.extra`)."""
    pairs = {
        int(k): {"distaccum": got[f"{engine}+exact"], "expert": got[engine]} for k, got in counts.items()
    }
    return extra(pairs, what)


def render(results: dict[str, Any]) -> str:
    """The price table (Markdown) of a stored result."""
    counts = results["counts"]
    high = counts[str(max(KS))]
    cuda = all("syncs" in got for per_k in counts.values() for got in per_k.values())
    rows = [
        "| engine | operators per micro-batch | operators per step | host syncs per micro-batch / per step | "
        "bytes reduced per step (exact / default) | fixed-point memory per parameter |",
        "|---|---|---|---|---|---|",
    ]
    for engine, shown in ENGINES.items():
        ops = price(counts, engine)
        syncs = (
            "{:+.0f} / {:+.0f}".format(*price(counts, engine, "syncs"))
            if cuda
            else "not counted on the CPU (`--device cuda`)"
        )
        exact, default = high[f"{engine}+exact"], high[engine]
        ratio = exact["reduced_bytes"] / default["reduced_bytes"]
        rows.append(
            f"| {shown} | {ops[0]:+.0f} | {ops[1]:+.0f} | {syncs} | {exact['reduced_bytes']:,} / "
            f"{default['reduced_bytes']:,} (x{ratio:g}) | "
            f"{exact['fixed_point_bytes'] / exact['params']:.1f} bytes |"
        )
    meta = results["meta"]
    return (
        "\n".join(rows)
        + f"\n\nExact mode against the default mode of the same engine, {high['ddp']['params']:,} fp32 parameters in "
        f"{high['ddp+exact']['tensors']} tensors "
        f"(`benchmarks/host_ops.py`'s MLP, micro-batch 4, SGD; FSDP2 unclipped in both modes), on rank 0 of {meta['world_size']} "
        f"{'NCCL' if cuda else 'gloo'} ranks, from the counts at K = {min(KS)} and K = {max(KS)}; operators outside "
        "the model's forward and backward, the loss and the optimizer, counted by torch.profiler (exact, the same "
        "on every run). Bytes: what this rank's step reduction takes in. Memory: the fixed-point buffers "
        f"(`distaccum/exact/fixed_point.py`) over the parameters. Code: commit `{meta['commit']}`, torch "
        f"{meta['torch']}, {meta['date']}. Command: `{DOCS_COMMAND}`. Stored: `docs/results/exact-price.json`."
    )


def publish(results: dict[str, Any]) -> None:
    """Keep ``results`` as :data:`STORE` and render the documents' sections from it."""
    STORE.parent.mkdir(parents=True, exist_ok=True)
    STORE.write_text(json.dumps(results, indent=1) + "\n")
    for doc in DOCS:
        doc.write_text(replace_section(doc.read_text(), "exact_price", render(results), by=DOCS_COMMAND))


def render_timing(results: dict[str, Any]) -> str:
    """The ``bench:exact_timing`` table of a :data:`TIMING_COMMAND` run's results.json."""
    lines = [
        "| case | K | rounds | engine | default, ms | exact, ms | exact / default (95 % interval) |",
        "|---|---:|---:|---|---:|---:|---|",
    ]
    for row in results["timing"]:
        rounds = {name: v["round_s"] for name, v in row["variants"].items()}
        for engine, (default, exact) in TIMED.items():
            s = spread(per_round_ratios(rounds[exact], rounds[default]))
            lines.append(
                f"| {row['case']} | {row['k']} | {row['rounds']} | {engine} "
                f"| {spread(rounds[default]).median * 1e3:.1f} | {spread(rounds[exact]).median * 1e3:.1f} "
                f"| {s.median:.2f}x ({s.ci_low:.2f}-{s.ci_high:.2f}) |"
            )
    meta = results["meta"]
    lines += [
        "",
        f"Median over rounds of each mode's step time (slowest rank) and of the per-round ratio, the four variants "
        f"alternating step by step in one world of {meta['world_size']} {meta['backend']} ranks "
        f"({meta['threads']}; exact mode turns on deterministic algorithms for the whole process, the default "
        f"variants' too). Code: commit `{meta['commit']}`, torch {meta['torch']}, {meta['cpu']}, "
        f"{meta['date'][:10]}. Command: `{meta['command']}`; rendered by `{TIMING_DOCS_COMMAND}`. Stored: "
        f"`docs/results/{TIMING_STORE.name}`.",
    ]
    return "\n".join(lines)


def publish_timing(path: Path) -> None:
    """Keep the timing run at ``path`` as :data:`TIMING_STORE` and render the documents' sections from it."""
    results = json.loads(path.read_text())
    if path.resolve() != TIMING_STORE.resolve():
        TIMING_STORE.write_text(json.dumps(results, indent=1) + "\n")
    for doc in DOCS:
        doc.write_text(
            replace_section(doc.read_text(), "exact_timing", render_timing(results), by=TIMING_DOCS_COMMAND)
        )
    print(render_timing(results))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.exact_price", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--publish", action="store_true")
    parser.add_argument("--render", action="store_true")
    parser.add_argument(
        "--timing",
        nargs="?",
        type=Path,
        const=ROOT / "runs" / "exact-timing" / "results.json",
        help="keep a timing run's results.json (default runs/exact-timing/results.json) and render its tables",
    )
    args = parser.parse_args(argv)
    if args.timing:
        publish_timing(args.timing)
        return 0
    if args.render:
        results = json.loads(STORE.read_text())
    else:
        out = (args.out or Path(tempfile.mkdtemp(prefix="exact-price-"))).resolve()
        out.mkdir(parents=True, exist_ok=True)
        results = {
            "meta": provenance(DOCS_COMMAND, device=args.device, world_size=world_for(args.device)),
            "settings": {"ks": list(KS), "variants": VARIANTS, "timing_command": TIMING_COMMAND},
            "counts": count(out, args.device),
        }
    print(render(results))
    if args.publish or args.render:
        publish(results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
