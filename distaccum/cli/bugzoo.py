"""``distaccum bugzoo [--run-dir DIR] [--only NAME,...] [--list]``: inject every known accumulation bug into
a real run, verify it and watch its runtime checks (:mod:`distaccum.verify.bugzoo`); print the table and
write ``DIR/bugzoo.json``. Exit codes: 0 every bug caught and every control clean; 1 a bug not caught or
a control that fired; 2 bad arguments."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK


def bugzoo_worker(plan_file: str) -> None:
    """``distaccum _bugzoo_worker PLAN``: one rank of the zoo's shared launch."""
    from distaccum.cli.worker import worker_exit
    from distaccum.verify.bugzoo import zoo_worker

    worker_exit(lambda: zoo_worker(Path(plan_file)))


def bugzoo_main(argv: list[str]) -> int:
    """Run the zoo (or the bugs named with ``--only``) and print its table."""
    from distaccum.verify.bugzoo import BUGS, ZOO_FILE, render, run_zoo

    parser = argparse.ArgumentParser(prog="distaccum bugzoo", description=__doc__)
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="where the runs and bugzoo.json go (default runs/bugzoo-<time>)",
    )
    parser.add_argument("--only", default="", help="comma-separated bug names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    try:
        opts = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and EXIT_CONFIG
    if opts.list:
        for bug in BUGS:
            print(f"{bug.name:<26} {bug.title}: {bug.what}")
        return EXIT_OK
    names = [n for n in opts.only.split(",") if n]
    unknown = sorted(set(names) - {b.name for b in BUGS})
    if unknown:
        print(
            f"distaccum: unknown bug(s) {', '.join(unknown)}; `distaccum bugzoo --list` names them",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    bugs = [b for b in BUGS if not names or b.name in names]
    root = opts.run_dir or Path("runs") / f"bugzoo-{time.strftime('%Y%m%d-%H%M%S')}"
    started = time.perf_counter()
    print(
        f"distaccum bugzoo: {len(bugs)} runs (each one verify: the plain reference vs world 2, micro-batch 2 x 4 "
        f"accumulation steps, 3 optimizer steps, with the runtime checks on) -> {root}",
        flush=True,
    )
    rows = run_zoo(root, bugs, echo=lambda line: print(line, flush=True))
    print("\n" + render(rows))
    print(f"\n{time.perf_counter() - started:.0f} s -> {root / ZOO_FILE}")
    missed = [r.bug for r in rows if not r.control and not r.caught]
    fired = [r.bug for r in rows if r.control and not r.diagnosis_correct]
    return EXIT_FAIL if missed or fired else EXIT_OK
