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

The order helps the two workers finish together (``--dist loadfile`` hands out whole files in
collection order): files of launching tests first, then the quick single-process ``unit`` files
that fill the gaps at the end, then the files of ``serial`` tests, which cost least where the other
worker has nothing left to run.
"""

from __future__ import annotations

import fcntl
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


def _file_rank(items: list[pytest.Item]) -> int:
    if all(item.get_closest_marker(MARKER) for item in items):
        return 2
    return 1 if all(item.get_closest_marker("unit") for item in items) else 0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    by_file: dict[Path, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.path, []).append(item)
    rank = {path: _file_rank(file_items) for path, file_items in by_file.items()}
    items.sort(key=lambda item: rank[item.path])  # stable: files keep their own order


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # outermost: waiting is not the test's time
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    with machine_share(exclusive=item.get_closest_marker(MARKER) is not None):
        yield
