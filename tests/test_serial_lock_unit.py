"""The lock that lets ``serial`` tests run alone while pytest-xdist runs the others two at a time."""

from __future__ import annotations

import fcntl
import tempfile
import threading
import time
from pathlib import Path

import pytest

import serial_lock
from serial_lock import machine_share

pytestmark = pytest.mark.unit


def _holder(
    name: str, exclusive: bool, log: list[str], entered: threading.Event, release: threading.Event
) -> threading.Thread:
    def hold() -> None:
        with machine_share(exclusive):
            log.append(f"{name} in")
            entered.set()
            assert release.wait(10)
            log.append(f"{name} out")

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    return thread


def _until_held(path: Path) -> None:
    """Return once somebody else holds ``path``'s lock exclusively."""
    deadline = time.monotonic() + 10
    with open(path, "a+b") as handle:
        while time.monotonic() < deadline:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(handle, fcntl.LOCK_UN)
            time.sleep(0.01)
    raise AssertionError(f"nobody took {path}")


def test_a_serial_test_waits_for_the_running_test_and_later_tests_wait_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "unit")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    log: list[str] = []
    events = {name: (threading.Event(), threading.Event()) for name in ("ordinary", "serial", "later")}

    first = _holder("ordinary", False, log, *events["ordinary"])
    assert events["ordinary"][0].wait(10)
    serial = _holder("serial", True, log, *events["serial"])
    _until_held(tmp_path / "distaccum-tests-unit" / "turnstile")  # the serial test is waiting
    later = _holder("later", False, log, *events["later"])
    time.sleep(0.3)
    assert log == ["ordinary in"]  # neither the serial test nor a later ordinary one got in

    events["ordinary"][1].set()
    assert events["serial"][0].wait(10)
    time.sleep(0.3)
    assert log == ["ordinary in", "ordinary out", "serial in"]  # the later test still waits

    events["serial"][1].set()
    assert events["later"][0].wait(10)
    events["later"][1].set()
    for thread in (first, serial, later):
        thread.join(10)
    assert log == ["ordinary in", "ordinary out", "serial in", "serial out", "later in", "later out"]


def test_ordinary_tests_share_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_TESTRUNUID", "unit")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with machine_share(exclusive=False):
        entered, release = threading.Event(), threading.Event()
        other = _holder("other", False, [], entered, release)
        assert entered.wait(10)  # a second ordinary test runs alongside
        release.set()
        other.join(10)


def test_without_xdist_nothing_is_locked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_TESTRUNUID", raising=False)
    with machine_share(exclusive=True), machine_share(exclusive=True):
        pass  # would deadlock if it locked


class _Item:
    def __init__(self, nodeid: str, *markers: str) -> None:
        self.nodeid, self.markers = nodeid, markers
        self.path = Path(nodeid.split("::")[0])

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


ORDERS = {
    "launching files go first, then unit files, then serial files": (
        None,
        [
            ("tests/test_a_unit.py::x", "unit"),
            ("tests/test_b_dist.py::x", "dist"),
            ("tests/test_c_serial.py::x", "dist", "serial"),
            ("tests/test_d_mixed.py::x", "dist"),
            ("tests/test_d_mixed.py::y", "dist", "serial"),
            ("tests/test_e_unit.py::x", "unit"),
            ("tests/test_b_dist.py::y", "dist"),
        ],
        ["b_dist::x", "d_mixed::x", "d_mixed::y", "b_dist::y", "a_unit::x", "e_unit::x", "c_serial::x"],
    ),
    # xdist hands out files in this order (--no-loadscope-reorder): a long file started last would run alone at the
    # end. Files durations.json does not list count as a typical launching file (unit files as one second).
    "the longest files go first by their measured time": (
        {"tests/test_short.py": 5.0, "tests/test_long.py": 90.0, "tests/test_mid.py": 40.0},
        [
            ("tests/test_short.py::x", "dist"),
            ("tests/test_new_unit.py::x", "unit"),
            ("tests/test_mid.py::x", "dist"),
            ("tests/test_new.py::x", "dist"),
            ("tests/test_long.py::x", "dist", "serial"),
            ("tests/test_long.py::y", "dist"),
        ],
        ["long::x", "long::y", "mid::x", "new::x", "short::x", "new_unit::x"],
    ),
}


@pytest.mark.parametrize("case", list(ORDERS))
def test_collection_order(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order the serial lock's hook sorts collected items into (expected ids: ``tests/test_NAME.py::TEST``)."""
    durations, made, expected = ORDERS[case]
    if durations is not None:
        monkeypatch.setattr(serial_lock, "_durations", lambda: durations)
    items = [_Item(*spec) for spec in made]
    serial_lock.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [item.nodeid for item in items] == [
        f"tests/test_{short}".replace("::", ".py::") for short in expected
    ]
