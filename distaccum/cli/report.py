"""``distaccum report RUN_DIR [RUN_DIR ...] [--out DIR]``: table, agreement check and figure.

Writes ``report.md`` and ``report.png`` into ``--out`` (default: the first RUN_DIR, which is the
sweep directory itself when given one) and prints the markdown. Exit codes: 0 report written and all
comparable loss curves agree; 1 report written but some comparable runs disagree; 2 bad arguments
(a path that is neither a run nor a sweep directory).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.helptext import plain_text
from distaccum.telemetry.figure import plot_report
from distaccum.telemetry.markdown import render_markdown
from distaccum.telemetry.report import build_rows, check_agreement, discover, gns_series

EXIT_DISAGREE, EXIT_USAGE = EXIT_FAIL, EXIT_CONFIG


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The report command's arguments."""
    parser = argparse.ArgumentParser(
        prog="distaccum report",
        description=plain_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "runs",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="run directories and/or sweep (multirun) directories",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where report.md and report.png go (default: the first RUN_DIR)",
    )
    parser.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="relative tolerance on per-step loss between comparable runs (default 1e-4)",
    )
    parser.add_argument(
        "--atol", type=float, default=1e-6, help="absolute tolerance on per-step loss (default 1e-6)"
    )
    return parser.parse_args(argv)


def report_main(argv: list[str]) -> int:
    """Entry of ``distaccum report``; returns the exit code."""
    try:
        args = parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on bad usage (2)
        return int(exc.code or 0)
    try:
        runs = discover(args.runs)
    except ValueError as err:
        print(f"distaccum report: {err}", file=sys.stderr)
        return EXIT_USAGE
    agreements = check_agreement(runs, args.rtol, args.atol)
    rows = build_rows(runs, agreements)
    out = args.out or args.runs[0]
    out.mkdir(parents=True, exist_ok=True)
    markdown = render_markdown(rows, agreements, runs, args.rtol, args.atol)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    plot_report(
        rows,
        {r.label: r.losses for r in runs},
        agreements,
        out / "report.png",
        args.rtol,
        {r.label: r.eval_losses for r in runs},
        gns={r.label: gns_series(r) for r in runs},
    )
    print(markdown)
    print(f"wrote {out / 'report.md'} and {out / 'report.png'}")
    return EXIT_OK if all(a.ok for a in agreements) else EXIT_DISAGREE
