"""``distaccum bugzoo [run_dir=DIR] [--only NAME,...] [--list]``: inject every known accumulation bug into
a real run, verify it and watch its runtime checks (:mod:`distaccum.verify.bugzoo`); print the table and
write ``DIR/bugzoo.json``. ``run_dir=DIR`` is the override ``train``, ``verify``, ``plan`` and ``submit``
take; ``--run-dir DIR`` means the same. Exit codes: 0 every bug caught and every control clean; 1 a bug not caught or a control
that fired; 2 bad arguments."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from distaccum.cli.exitcodes import EXIT_CONFIG, EXIT_FAIL, EXIT_OK
from distaccum.cli.helptext import plain_text

RUN_DIR_KEY = "run_dir"
"""The one override the zoo takes: its runs' configurations are fixed by the bugs."""


def bugzoo_worker(runs_file: str) -> None:
    """``distaccum _bugzoo_worker RUNS``: one rank of the zoo's shared launch."""
    from distaccum.cli.worker import worker_exit
    from distaccum.verify.bugzoo import zoo_worker

    worker_exit(lambda: zoo_worker(Path(runs_file)))


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The zoo's options from ``argv``: ``run_dir=DIR`` or ``--run-dir DIR``, ``--only``, ``--list``.

    Exits through ``parser.error`` (status 2, the accepted forms named) on any other override."""
    parser = argparse.ArgumentParser(prog="distaccum bugzoo", description=plain_text(__doc__ or ""))
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="run_dir=DIR",
        help="where the runs and bugzoo.json go (default runs/bugzoo-<time>), as for `distaccum train`",
    )
    parser.add_argument("--run-dir", type=Path, default=None, metavar="DIR", help="the same as run_dir=DIR")
    parser.add_argument(
        "--only", default="", metavar="NAME,...", help="comma-separated bug names (default: all)"
    )
    parser.add_argument("--list", action="store_true", help="list the bugs and exit")
    opts = parser.parse_args(argv)
    for override in opts.overrides:
        key, eq, value = override.partition("=")
        if key != RUN_DIR_KEY or not eq or not value:
            parser.error(
                f"{override!r}: bugzoo takes run_dir=DIR (or --run-dir DIR), --only NAME,... and --list; "
                "the configurations of its runs are fixed by the bugs"
            )
        if opts.run_dir is not None and opts.run_dir != Path(value):
            parser.error(f"two run directories: {opts.run_dir} and {value}; give one")
        opts.run_dir = Path(value)
    return opts


def bugzoo_main(argv: list[str]) -> int:
    """Run the zoo (or the bugs named with ``--only``) and print its table."""
    from distaccum.verify.bugzoo import BUGS, ZOO_FILE, render, run_zoo

    try:
        opts = parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help (0) and on bad usage (2)
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
