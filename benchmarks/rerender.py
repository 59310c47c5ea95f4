"""A stored run's tables with this release's ratios: ``python -m benchmarks.rerender RESULTS.json``.

``benchmarks.run`` computes the ratios of :data:`benchmarks.stats.RATIOS` when it writes ``results.json``; a ratio
defined since (two diagnostic variants compared for the first time) is missing from older runs. This recomputes every
launch's ratios from the round times the file keeps (the same per-round ratios, intervals and verdicts
``benchmarks.run`` gives) and prints the run's markdown (``results.md``'s tables; ``--out FILE`` writes it there).

    python -m benchmarks.rerender docs/results/cpu-step-by-step-27m-k4-hooks.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import render
from benchmarks.stats import ratios_of


def recomputed(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with every timing launch's ratios computed again from its variants' round times."""
    timing = []
    for row in results["timing"]:
        rounds = {name: variant["round_s"] for name, variant in row.get("variants", {}).items()}
        timing.append({**row, "ratios": ratios_of(rounds, row["case"], row["k"])} if rounds else row)
    return {**results, "timing": timing}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.rerender", description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path, help="a results.json written by benchmarks.run")
    p.add_argument("--out", type=Path, help="write the markdown here instead of printing it")
    args = p.parse_args(argv)
    if not args.results.is_file():
        print(f"rerender: no such file: {args.results}", file=sys.stderr)
        return 2
    markdown = render(recomputed(json.loads(args.results.read_text())))
    if args.out is not None:
        args.out.write_text(markdown)
    else:
        sys.stdout.write(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
