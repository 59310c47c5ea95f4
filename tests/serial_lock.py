"""Tests marked ``serial`` run alone, even when pytest-xdist runs the rest two at a time.

``make test`` runs the suite on two pytest-xdist workers (most tests wait on subprocess start-up
far more than they compute, so two at a time fill the cores). A few tests assert wall-clock times
or compare timings between runs; another worker's launches would make them flaky. Those are
marked ``@pytest.mark.serial``; this plugin gives them the machine to themselves.

Every test holds a reader-writer lock over its whole protocol (setup, call, teardown, so module
fixtures built in a test's setup are covered too): shared for ordinary tests, exclusive for
``serial`` ones. A second lock, the turnstile, makes the exclusive side win: a serial test takes
the turnstile before waiting, and ordinary tests pass the turnstile before taking their shared
lock, so none can start once a serial test is waiting. Locks are ``flock``s on files named
after xdist's run id, released by the kernel if a worker dies. Without xdist this does nothing.

The order helps the two workers finish together (``--dist loadfile --no-loadscope-reorder`` hands out whole files
in collection order; xdist's own reorder, by number of tests, sent the few-test, long-running files last): the
longest files first, as a whole run measured them (tests/durations.json, written by ``tests/tiers.py --store``; a
file not there counts as :data:`UNKNOWN_S`), so that the last ones to start are short and fill the gaps, then the
files of ``serial`` tests, which cost least where the other worker has nothing left to run.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

MARKER = "serial"


def _lock_dir() -> Path | None:
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set by xdist in every worker of one run
    return Path(tempfile.gettempdir()) / f"distaccum-tests-{run_id}" if run_id else None


@contextmanager
def _flock(path: Path, mode: int) -> Iterator[IO[bytes]]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle, mode)
        try:
            yield handle
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def machine_share(exclusive: bool) -> Iterator[None]:
    """Hold the machine shared (ordinary test) or alone (``serial`` test) for the duration."""
    where = _lock_dir()
    if where is None:
        yield
        return
    where.mkdir(exist_ok=True)
    turnstile, share = where / "turnstile", where / "share"
    if exclusive:  # readers queue at the turnstile while this waits for the running ones to end
        with _flock(turnstile, fcntl.LOCK_EX), _flock(share, fcntl.LOCK_EX):
            yield
    else:
        with _flock(turnstile, fcntl.LOCK_EX):
            pass  # not while a serial test waits or runs
        with _flock(share, fcntl.LOCK_SH):
            yield


UNKNOWN_S = 30.0
"""The time assumed for a test file durations.json does not list (a new one): a typical launching file."""


def _durations() -> dict[str, float]:
    path = Path(__file__).resolve().parent / "durations.json"
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return {}


def _file_key(path: Path, items: list[pytest.Item], durations: dict[str, float]) -> tuple[int, float]:
    """(1 for a file of serial tests only, else 0; minus its expected seconds): the longest files first."""
    serial = all(item.get_closest_marker(MARKER) for item in items)
    expected = durations.get(f"tests/{path.name}")
    if expected is None:
        expected = 1.0 if all(item.get_closest_marker("unit") for item in items) else UNKNOWN_S
    return (1 if serial else 0, -expected)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    durations = _durations()
    key = {path: _file_key(path, file_items, durations) for path, file_items in by_file.items()}
    items.sort(key=lambda item: key[item.path])  # stable: a file's tests keep their own order


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: waiting is not the test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    # Not an xdist worker: a pytest that a test started (benchmarks/gpu_check.sh's gpu tier). It inherits the run's id
    # but must not queue behind the run's locks: its parent test holds a share, and a serial test waiting on the other
    # worker closed the turnstile (it waited until its 150 s limit once, when the order put the two side by side).
    if not hasattr(item.config, "workerinput"):
        yield
        return
    with machine_share(exclusive=item.get_closest_marker(MARKER) is not None):
        yield
