"""Each rank's last sign of life, so a failure can name the rank that caused it.

Every rank keeps ``run_dir/ranks/rank-NNNNN.json`` (pid, host, restart attempt, last finished
optimizer step, state). A rank that fails in Python marks its file ``failed`` with the error; a
rank stopped by the launcher marks it ``stopped``; a rank that is killed (SIGKILL, the OOM killer,
a crash in native code) cannot write anything, so its file still says ``running``. When a
collective times out or loses a peer, and when torch elastic restarts the group, these files (and,
for ranks on this host, ``/proc``) tell which rank it was.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distaccum.rundir import RANKS, read_json, write_text_atomic

PROC_STATES = {
    "T": "stopped (SIGSTOP, or suspended by a debugger)",
    "t": "stopped by a tracer",
    "Z": "dead (it exited or was killed, and has not been reaped yet)",
    "D": "in uninterruptible sleep (disk or network I/O)",
}


def short_error(err: BaseException) -> str:
    """An exception as one short line for a rank file and a message."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"[:200]


def is_timeout(err: BaseException) -> bool:
    """Whether a failed collective timed out. Gloo words it "Timed out waiting ...ms for recv", or,
    when the op had a callback (the async window all-reduce), "Application timeout caused pair closure"."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def rank_file(run_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its sign of life."""
    return Path(run_dir) / RANKS / f"rank-{rank:05d}.json"


@dataclass
class Liveness:
    """Writes this rank's sign of life: one small file, atomically replaced, at most once a second
    while running (a replace costs ~3 ms on some file systems: per step it would show)."""

    run_dir: Path
    rank: int
    attempt: int
    interval_s: float = 1.0
    _last: float = -1e9

    def write(self, state: str, **fields: Any) -> None:
        """Record ``state`` ('running', 'failed', 'stopped', 'finished') and extra fields."""
        path = rank_file(self.run_dir, self.rank)
        value = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "attempt": self.attempt,
            "state": state,
            "time": time.time(),
            **fields,
        }
        write_text_atomic(path, json.dumps(value) + "\n")

    def beat(self, step: int) -> None:
        """After an optimizer step (written when ``interval_s`` passed since the last write)."""
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            self._last = now
            self.write("running", step=step)


def read_ranks(run_dir: Path) -> list[dict[str, Any]]:
    """Every rank file of a run, by rank."""
    folder = Path(run_dir) / RANKS
    files = sorted(folder.glob("rank-*.json")) if folder.is_dir() else []
    return [value for value in (read_json(f) for f in files) if value]


def process_state(pid: int) -> str | None:
    """This host's view of ``pid``: None when it is gone, else its /proc state letter."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("State:"):
                    return line.split()[1]
    except OSError:
        return None
    return "?"


def describe_peers(run_dir: Path, me: int) -> list[str]:
    """What is known about the other ranks when a collective failed: one line per suspicious rank."""
    host = socket.gethostname()
    now = time.time()
    lines = []
    for info in read_ranks(run_dir):
        rank = int(info["rank"])
        if rank == me:
            continue
        seen = f"last finished step {info.get('step', 0)}, {now - float(info['time']):.0f} s ago"
        if info["state"] == "failed":
            lines.append(f"rank {rank} failed: {info.get('error', '?')} ({seen})")
        elif info.get("host") == host:
            state = process_state(int(info["pid"]))
            if state is None:
                lines.append(
                    f"rank {rank} (pid {info['pid']}) is gone: it died without a trace "
                    f"(killed by a signal such as SIGKILL, the OOM killer, or a crash in native code; {seen})"
                )
            elif state in PROC_STATES:
                lines.append(f"rank {rank} (pid {info['pid']}) is {PROC_STATES[state]} ({seen})")
        elif info["state"] == "running":
            lines.append(f"rank {rank} on {info.get('host')}: {seen} (not checkable from {host})")
    return lines


def kill_stopped_peers(run_dir: Path, me: int, attempt: int) -> list[int]:
    """SIGKILL the ranks of this run and attempt that are stopped (state T) on this host.

    A stopped rank can never take part again and ignores the launcher's SIGTERM, so torch elastic
    would wait its full 30 s grace before killing it; the run is failing anyway, so end it now.
    Returns the ranks killed.
    """
    host = socket.gethostname()
    killed = []
    for info in read_ranks(run_dir):
        rank, pid = int(info["rank"]), int(info["pid"])
        if (
            rank != me
            and info.get("host") == host
            and int(info.get("attempt", -1)) == attempt
            and process_state(pid) == "T"
        ):
            try:
                os.kill(pid, 9)
                killed.append(rank)
            except OSError:
                pass
    return killed


def previous_attempt(run_dir: Path, attempt: int) -> list[str]:
    """After an elastic restart: what happened to each rank in the attempt before ``attempt`` (ranks
    that died without a trace first: they are the cause, the others failed because of them)."""
    lines: list[str] = []
    for info in read_ranks(run_dir):
        if int(info.get("attempt", -1)) != attempt - 1:
            continue
        rank, step = int(info["rank"]), info.get("step", 0)
        if info["state"] == "running":
            lines.insert(
                0,
                f"rank {rank} (pid {info['pid']} on {info.get('host')}) died without a trace after "
                f"step {step} (killed by a signal such as SIGKILL, the OOM killer, or a crash in native "
                "code)",
            )
        elif info["state"] == "failed":
            lines.append(f"rank {rank} failed after step {step}: {info.get('error', '?')}")
    return lines
