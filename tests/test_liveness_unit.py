"""Rank files and the words a failed run uses to name the rank that caused it (real processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distaccum.rundir.liveness import (
    Liveness,
    describe_peers,
    is_timeout,
    kill_stopped_peers,
    process_state,
    read_ranks,
)

pytestmark = pytest.mark.unit


def test_gloo_timeouts_are_recognised_in_both_wordings() -> None:
    assert is_timeout(RuntimeError("[../gloo/transport/tcp/pair.cc:534] Timed out waiting 10000ms for recv"))
    assert is_timeout(
        RuntimeError(
            "Got the following error when running the callback: RuntimeError: "
            "Application timeout caused pair closure"
        )
    )
    assert not is_timeout(RuntimeError("Connection reset by peer"))


def test_beats_are_rate_limited_but_state_changes_are_not(tmp_path: Path) -> None:
    live = Liveness(tmp_path, rank=0, attempt=0, interval_s=60.0)
    live.beat(1)
    live.beat(2)  # within the interval: not written
    assert [r["step"] for r in read_ranks(tmp_path)] == [1]
    live.write("failed", step=2, error="boom")
    assert read_ranks(tmp_path)[0]["state"] == "failed"


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _wait_state(pid: int, want: str | None) -> None:
    deadline = time.monotonic() + 10
    while process_state(pid) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_state(pid) == want


def test_a_stopped_peer_is_named_and_killed_a_gone_one_named(tmp_path: Path) -> None:
    stopped, gone = _sleeper(), _sleeper()
    try:
        for rank, proc in ((1, stopped), (2, gone)):
            live = Liveness(tmp_path, rank=rank, attempt=0)
            live.write("running", step=4)
            info = tmp_path / "ranks" / f"rank-{rank:05d}.json"  # the peer's pid, not this test's
            info.write_text(info.read_text().replace(f'"pid": {os.getpid()}', f'"pid": {proc.pid}'))
        os.kill(stopped.pid, signal.SIGSTOP)
        _wait_state(stopped.pid, "T")
        gone.kill()
        gone.wait()
        lines = describe_peers(tmp_path, me=0)
        assert any(f"rank 1 (pid {stopped.pid}) is stopped (SIGSTOP" in line for line in lines), lines
        assert any(f"rank 2 (pid {gone.pid}) is gone: it died without a trace" in line for line in lines), (
            lines
        )
        assert kill_stopped_peers(tmp_path, me=0, attempt=1) == []  # another attempt's rank files: left alone
        assert kill_stopped_peers(tmp_path, me=0, attempt=0) == [1]
        stopped.wait(timeout=10)
        assert stopped.returncode == -signal.SIGKILL
    finally:
        for proc in (stopped, gone):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
