"""Running a candidate or the reference in this process with its console captured: ``distaccum verify`` and
``distaccum bugzoo`` keep every run's output in its run directory (``console.log``) and their own table readable."""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from distaccum.rundir import CONSOLE_LOG

EXIT_OK, EXIT_FAIL = 0, 1
"""A run's exit codes as ``distaccum verify`` reports them (the CLI's own, kept below the entry layer)."""


@contextmanager
def output_to(path: Path, *, append: bool = False) -> Iterator[None]:
    """This process's (and its children's) stdout/stderr into ``path`` for the block; ``append`` adds to the file
    (every rank of a launch into one) instead of starting it afresh."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)


@contextmanager
def console_to(path: Path) -> Iterator[None]:
    """Send this process's (and its children's) stdout/stderr to ``path``: the table stays readable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    env_before = dict(os.environ)
    # Verify runs are tiny: one intra-op thread per worker. Two threads on a loaded 2-core machine
    # made the world-1 reference 3-10x slower (spinning OpenMP workers); a user's setting wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        with output_to(path):
            yield
    finally:
        os.environ.clear()
        os.environ.update(env_before)


def log_tail(run_dir: Path, lines: int = 15) -> str:
    """The last lines of a run's ``console.log``, indented."""
    path = run_dir / CONSOLE_LOG
    text = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return "\n".join("    | " + line for line in text[-lines:])


def timed_run(run: Callable[[], int], log: Path) -> tuple[int, float]:
    """Run ``run`` with its console output in ``log``; (exit code, seconds). An exception is exit 1."""
    start = time.perf_counter()
    with console_to(log):
        try:
            code = run()
        except Exception:  # noqa: BLE001 - an in-process reference that raised is a failed run
            traceback.print_exc()
            code = EXIT_FAIL
    return code, time.perf_counter() - start
